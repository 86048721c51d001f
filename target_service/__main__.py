"""python -m target_service: serve the target model (default: the embedded SmolLM2-135M-Instruct)."""

from specbatch.service.main import run_model_service

from .servicer import TargetServicer


def main(argv=None):
    run_model_service("target", TargetServicer.serve_on, argv)


if __name__ == "__main__":
    main()

"""python -m target_service: serve the target model (default: the embedded SmolLM2-135M-Instruct)."""

from specbatch.rpc.server import exit_if_port_in_use, exit_stopped


def main(argv=None):
    exit_if_port_in_use("target", argv)  # a port in use stops it before the imports of seconds below
    from specbatch.service.main import run_model_service

    from .servicer import TargetServicer

    run_model_service("target", TargetServicer.serve_on, argv)


if __name__ == "__main__":
    main()
    exit_stopped()

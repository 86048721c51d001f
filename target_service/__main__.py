"""python -m target_service: serve the target model (default: the embedded SmolLM2-135M-Instruct)."""

from specbatch.models.embedded import EMBEDDED
from specbatch.rpc.server import DEFAULT_PORTS
from specbatch.service.model_service import run_model_service

from .servicer import TargetServicer


def main(argv=None):
    run_model_service("target", DEFAULT_PORTS["target"], EMBEDDED, TargetServicer.serve_on, argv)


if __name__ == "__main__":
    main()

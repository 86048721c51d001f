"""python -m draft_service: serve a draft model (default: the embedded target's first layers)."""

from specbatch.model_service import run_model_service
from specbatch.models import EMBEDDED_DRAFT_LAYERS
from specbatch.serving import DEFAULT_PORTS

from .servicer import DraftServicer


def main(argv=None):
    run_model_service("draft", DEFAULT_PORTS["draft"], EMBEDDED_DRAFT_LAYERS, DraftServicer.serve_on, argv)


if __name__ == "__main__":
    main()

"""python -m draft_service: serve a draft model (default: the embedded target's distilled draft)."""

from specbatch.models.embedded import EMBEDDED_DRAFT
from specbatch.rpc.server import DEFAULT_PORTS
from specbatch.service.model_service import run_model_service

from .servicer import DraftServicer


def main(argv=None):
    run_model_service("draft", DEFAULT_PORTS["draft"], EMBEDDED_DRAFT, DraftServicer.serve_on, argv)


if __name__ == "__main__":
    main()

"""python -m draft_service: serve a draft model (default: the embedded target's distilled draft)."""

from specbatch.service.main import run_model_service

from .servicer import DraftServicer


def main(argv=None):
    run_model_service("draft", DraftServicer.serve_on, argv)


if __name__ == "__main__":
    main()

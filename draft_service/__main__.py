"""python -m draft_service: serve a draft model (default: the embedded target's distilled draft)."""

from specbatch.rpc.server import exit_if_port_in_use, exit_stopped


def main(argv=None):
    exit_if_port_in_use("draft", argv)  # a port in use stops it before the imports of seconds below
    from specbatch.service.main import run_model_service

    from .servicer import DraftServicer

    run_model_service("draft", DraftServicer.serve_on, argv)


if __name__ == "__main__":
    main()
    exit_stopped()

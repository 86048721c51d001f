from specbatch.rpc.server import exit_if_port_in_use, exit_stopped

if __name__ == "__main__":
    exit_if_port_in_use("coordinator")  # a port in use stops it before the imports of seconds below
    from .app import main

    main()
    exit_stopped()

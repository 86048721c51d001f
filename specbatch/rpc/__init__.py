"""Transport: gRPC server plumbing, the same calls on a Unix socket, TLS, reflection, metrics, logs and a client."""

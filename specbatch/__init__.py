"""specbatch: speculative decoding under continuous batching, as a draft/target gRPC service pair."""

__version__ = "0.1.0"

"""The engine's CPU kernels: C sources built on first use, the CPU features that choose them, and the linear layers over them."""

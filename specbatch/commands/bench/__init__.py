"""`specbatch bench` and the engine and sampling benchmarks beside it."""

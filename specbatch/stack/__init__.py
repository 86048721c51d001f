"""Starting the three services together: as processes (`specbatch up`) or in one process (tests, benchmarks)."""

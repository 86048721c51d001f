"""The models the engine runs: its own forwards (Llama, OPT, the EAGLE-style draft), transformers' for the rest, and loading."""

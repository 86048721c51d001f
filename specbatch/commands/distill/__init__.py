"""`specbatch distill`: train an EAGLE-style draft for a target."""

"""The engine both model services run: one KV pool, ragged batched calls, captured steps, sampling and the acceptance rule."""

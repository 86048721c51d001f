"""The forward/KV-cache engine shared by the draft service and the target service.

Every sequence owns one KV buffer, ``[layers, 2 (key/value), kv_heads, capacity, head_dim]``,
that lives across calls and is keyed by the sequence id. A batched call:

1. gathers the cached prefix of each of its sequences into one padded batch cache,
2. runs only the *new* tokens of every sequence through the model (one forward for all rows),
   optionally followed by more one-token decode forwards (the draft's proposal loop),
3. copies back the keys/values of the fed tokens each sequence keeps.

So a step never recomputes a cached prefix, and rolling a sequence back is O(1): its length is
set lower and the stale tail is overwritten by the next call.

Row layout inside one call (``P`` = longest kept prefix, ``N`` = most new tokens)::

    [ pad | prefix_i ][ pad | new_i ][ decode steps ... ]
    0           P-1   P          P+N-1

Prefixes are right-aligned to column ``P`` and new tokens to column ``P+N``, so each row's fed
tokens form one contiguous run. Padding columns are masked out through the 2D attention mask and
positions are passed explicitly, so RoPE and absolute-position models see the same positions as an
unpadded run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class EngineError(Exception):
    """A request the engine refuses; ``code`` names the gRPC status the servicers map it to."""

    code = "INVALID_ARGUMENT"


class InvalidRequest(EngineError):
    code = "INVALID_ARGUMENT"


class UnknownSequence(EngineError):
    code = "NOT_FOUND"


class CapacityExceeded(EngineError):
    code = "RESOURCE_EXHAUSTED"


class StaleCache(EngineError):
    """The caller believes more tokens are cached than the service holds (e.g. it restarted)."""

    code = "FAILED_PRECONDITION"


@dataclass
class SequenceInput:
    """What one call asks of one sequence: keep ``keep_len`` cached tokens, then feed ``tokens``."""

    seq_id: str
    keep_len: int
    tokens: list[int]


@dataclass
class SequenceCache:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]


class _BatchLayer(DynamicLayer):
    """One layer of a call's batch cache: a preallocated buffer written in place.

    HF's DynamicLayer concatenates on every forward (a full copy of the cache per token); here the
    call already knows how many columns it needs, so updates are slice writes.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys_buffer, self.values_buffer = keys, values
        self.length = length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.keys_buffer[:, :, self.length : end] = key_states
        self.values_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.keys_buffer[:, :, :end], self.values_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.length + query_length, 0


class RaggedBatch:
    """The sequences of one call, gathered into a padded batch cache (see the module docstring)."""

    def __init__(self, engine: "Engine", inputs: list[SequenceInput], decode_steps: int = 0):
        self.engine = engine
        self.inputs = inputs
        self.kept = [item.keep_len for item in inputs]
        self.fed = [len(item.tokens) for item in inputs]
        batch, prefix_cols, new_cols = len(inputs), max(self.kept), max(self.fed)
        self.prefix_cols, self.new_cols = prefix_cols, new_cols
        capacity = prefix_cols + new_cols + decode_steps
        layers, kv_heads, head_dim = engine.kv_shape
        device = engine.device
        # Zeros, not empty: padding columns are masked, but garbage NaNs would still leak
        # through `0 * NaN` in the attention-weighted sum.
        self.buffer = torch.zeros(
            layers, 2, batch, kv_heads, capacity, head_dim, dtype=engine.dtype, device=device
        )
        self.mask = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        input_ids = torch.zeros(batch, new_cols, dtype=torch.long)
        positions = torch.zeros(batch, new_cols, dtype=torch.long)
        for row, item in enumerate(inputs):
            kept, fed = self.kept[row], self.fed[row]
            if kept:
                cache = engine.sequences[item.seq_id]
                self.buffer[:, :, row, :, prefix_cols - kept : prefix_cols] = cache.kv[:, :, :, :kept]
                self.mask[row, prefix_cols - kept : prefix_cols] = 1
            self.mask[row, prefix_cols + new_cols - fed : prefix_cols + new_cols] = 1
            input_ids[row, new_cols - fed :] = torch.tensor(item.tokens, dtype=torch.long)
            positions[row, new_cols - fed :] = torch.arange(kept, kept + fed)
        self.cache = Cache(
            layers=[_BatchLayer(self.buffer[i, 0], self.buffer[i, 1], prefix_cols) for i in range(layers)]
        )
        self._pending = (input_ids.to(device), positions.to(device))
        self.columns = prefix_cols  # columns filled so far
        self.decoded = 0

    def _forward(self, input_ids, positions, logits_to_keep: int) -> torch.Tensor:
        width = input_ids.shape[1]
        out = self.engine.model(
            input_ids=input_ids,
            attention_mask=self.mask[:, : self.columns + width],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.columns += width
        return out.logits.float()

    @torch.inference_mode()
    def prefill(self, logits_to_keep: int = 1) -> torch.Tensor:
        """Run every row's new tokens; returns logits of the last ``logits_to_keep`` columns."""
        input_ids, positions = self._pending
        return self._forward(input_ids, positions, logits_to_keep)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one more token per row; returns ``[batch, vocab]`` logits."""
        self.mask[:, self.columns] = 1
        positions = torch.tensor(
            [[k + f + self.decoded] for k, f in zip(self.kept, self.fed)], device=self.engine.device
        )
        self.decoded += 1
        return self._forward(tokens.view(-1, 1).to(self.engine.device), positions, 1)[:, -1]

    def commit(self, keep: list[int]) -> None:
        """Store, per row, the keys/values of the first ``keep[row]`` tokens it was fed."""
        start = self.prefix_cols + self.new_cols
        for row, item in enumerate(self.inputs):
            n = keep[row]
            assert 0 <= n <= self.fed[row] + self.decoded
            cache = self.engine.sequences[item.seq_id]
            kept = self.kept[row]
            self.engine._reserve(cache, kept + n)
            first = start - self.fed[row]
            cache.kv[:, :, :, kept : kept + n] = self.buffer[:, :, row, :, first : first + n]
            cache.length = kept + n


@dataclass
class Engine:
    """A model plus the KV caches of the sequences it serves, keyed by sequence id."""

    model: torch.nn.Module
    max_sequences: int = 256
    max_context: int | None = None
    sequences: dict[str, SequenceCache] = field(default_factory=dict)

    def __post_init__(self):
        self.model.eval()
        config = self.model.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.max_context = self.max_context or getattr(config, "max_position_embeddings", None) or 2048
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_shape = self._probe_kv_shape()

    @torch.inference_mode()
    def _probe_kv_shape(self) -> tuple[int, int, int]:
        """Read the per-layer KV shape off a one-token forward; all layers must agree."""
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), past_key_values=cache)
        shapes = {tuple(layer.keys.shape[1::2]) for layer in cache.layers}
        if len(shapes) != 1:
            raise ValueError(f"models whose layers cache keys of different shapes are not supported: {shapes}")
        (kv_heads, head_dim), = shapes
        return len(cache.layers), kv_heads, head_dim

    # ---- sequence bookkeeping -------------------------------------------------------------------

    def length(self, seq_id: str) -> int:
        return self._get(seq_id).length

    def _get(self, seq_id: str) -> SequenceCache:
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence id {seq_id!r}") from None

    def _reserve(self, cache: SequenceCache, length: int) -> None:
        if length <= cache.capacity:
            return
        capacity = min(max(length, 2 * cache.capacity), self.max_context)
        layers, kv_heads, head_dim = self.kv_shape
        kv = torch.empty(layers, 2, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
        kv[:, :, :, : cache.length] = cache.kv[:, :, :, : cache.length]
        cache.kv = kv

    def _new_cache(self, length_hint: int) -> SequenceCache:
        layers, kv_heads, head_dim = self.kv_shape
        capacity = min(max(64, 1 << (max(length_hint, 1) - 1).bit_length()), self.max_context)
        return SequenceCache(torch.empty(layers, 2, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device))

    def validate_rollback(self, seq_id: str, length: int) -> SequenceCache:
        cache = self._get(seq_id)
        if not 0 <= length <= cache.length:
            raise InvalidRequest(f"sequence {seq_id!r} holds {cache.length} tokens; cannot roll back to {length}")
        return cache

    def truncate(self, seq_id: str, length: int) -> int:
        """Roll a sequence back to its first ``length`` tokens."""
        self.validate_rollback(seq_id, length).length = length
        return length

    def release(self, seq_ids: list[str]) -> int:
        """Forget sequences; unknown ids are ignored so that release is idempotent."""
        return sum(self.sequences.pop(seq_id, None) is not None for seq_id in seq_ids)

    # ---- batched calls --------------------------------------------------------------------------

    def validate(self, inputs: list[SequenceInput], extra_tokens: list[int], create: bool) -> None:
        """Check a whole call before touching any state, so a bad call changes nothing."""
        if not inputs:
            raise InvalidRequest("a call needs at least one sequence")
        seen: set[str] = set()
        new = 0
        for item, extra in zip(inputs, extra_tokens):
            if not item.seq_id:
                raise InvalidRequest("sequence id must not be empty")
            if item.seq_id in seen:
                raise InvalidRequest(f"sequence id {item.seq_id!r} appears twice in one call")
            seen.add(item.seq_id)
            cache = self.sequences.get(item.seq_id)
            if cache is None:
                if not create:
                    raise UnknownSequence(f"unknown sequence id {item.seq_id!r}")
                if item.keep_len:
                    raise StaleCache(f"sequence {item.seq_id!r} is not cached here; keep_len must be 0")
                new += 1
            elif item.keep_len > cache.length:
                raise StaleCache(
                    f"sequence {item.seq_id!r} holds {cache.length} tokens here, fewer than keep_len={item.keep_len}"
                )
            if not item.tokens:
                raise InvalidRequest(f"sequence {item.seq_id!r}: no new tokens to feed")
            bad = [t for t in item.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"sequence {item.seq_id!r}: token ids {bad[:5]} outside [0, {self.vocab_size})")
            total = item.keep_len + len(item.tokens) + extra
            if total > self.max_context:
                raise InvalidRequest(
                    f"sequence {item.seq_id!r} would reach {total} tokens, over the model's context of {self.max_context}"
                )
        if len(self.sequences) + new > self.max_sequences:
            raise CapacityExceeded(
                f"{len(self.sequences)} sequences cached and {new} more asked for; the limit is {self.max_sequences}"
            )

    def start(self, inputs: list[SequenceInput], decode_steps: int = 0, create: bool = False,
              extra_tokens: list[int] | None = None) -> RaggedBatch:
        """Validate a call, create new sequences if allowed, and gather its batch cache."""
        self.validate(inputs, extra_tokens or [decode_steps] * len(inputs), create)
        for item in inputs:
            if item.seq_id not in self.sequences:
                self.sequences[item.seq_id] = self._new_cache(len(item.tokens))
        return RaggedBatch(self, inputs, decode_steps)

    def cached_tokens(self) -> int:
        return sum(cache.length for cache in self.sequences.values())

    def prefill(self, inputs: list[SequenceInput]) -> list[int]:
        """Add or extend sequences: cache all their tokens. Returns each one's cached length."""
        batch = self.start(inputs, create=True)
        batch.prefill(1)
        batch.commit(batch.fed)
        return [item.keep_len + fed for item, fed in zip(inputs, batch.fed)]

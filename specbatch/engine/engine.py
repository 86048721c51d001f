"""The forward/KV-cache engine shared by the draft service and the target service.

All sequences of an engine live in one KV pool, ``[layers, 2 (key/value), slots, kv_heads,
context, head_dim]``: each sequence owns a slot, keyed by its id, and its tokens fill the first
``length`` columns of that slot. The pool lives across calls. A batched call runs only the *new*
tokens of each of its sequences (ragged: each its own count) through the model once, with the
new keys/values written straight into each sequence's slot at its own next columns and a 4D mask
that lets each row see exactly its own columns. So:

- a step never recomputes a cached prefix, and never copies one either when the call's sequences
  hold neighbouring slots (the common case: slots are kept dense, and the coordinator sends the
  whole running batch), the batch cache is a view of the pool; other calls gather their slots;
- rolling back is O(1): a sequence's length is set lower, and the stale columns are masked and
  later overwritten;
- positions are passed explicitly, so RoPE and absolute-position models see the same positions as
  an unpadded run.

Within a call, new tokens are right-aligned (so the last positions of every row share columns of
the logits); a padding token writes its keys/values to a scratch column past every row's end and
attends only column 0, which keeps it finite.

The forward itself is ``Engine.forward``: the engine's own, weights prepacked (``specbatch.models.llama``
for Llama-family models and the EAGLE draft, ``specbatch.models.opt`` for OPT; ``OWN_FORWARDS``), or
``specbatch.models.transformers_forward`` (any other model). All return the final hidden states beside
the logits: the target service sends them to an EAGLE-style draft (``specbatch.models.eagle``), which
reads one such feature per fed token as a second input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from specbatch.engine.batch import RaggedBatch, SequenceInput, length_groups
from specbatch.engine.buckets import resolve_mode
from specbatch.engine.captured import CapturedForward
from specbatch.engine.kv_pool import KVPool, SequenceCache
from specbatch.engine.model_thread import ModelThread
from specbatch.kernels import build
from specbatch.models import llama, opt
from specbatch.models.eagle import reads_target_features
from specbatch.models.transformers_forward import TransformersForward
from specbatch.protocol.errors import MAX_SEQ_ID_LENGTH, CapacityExceeded, InvalidRequest, StaleCache, UnknownSequence

# The engine's own forwards, each beside the test of which models it covers.
OWN_FORWARDS = ((llama.supports, llama.LlamaForward), (opt.supports, opt.OptForward))


def own_forward(model):
    """The engine's own forward class that covers ``model``, or None (it then runs through
    transformers: ``specbatch.models.transformers_forward``)."""
    return next((forward for supports, forward in OWN_FORWARDS if supports(model)), None)


# The own forward's weight forms (``Engine.weights``; specbatch.kernels.forms says which the machine
# picks): how messages name each, whether this CPU runs it, and what it needs.
WEIGHT_FORMS = {
    "bf16": ("bf16 weights", lambda: build.available(), "a CPU where the panel kernel builds"),
    "bf16-dot": ("bf16 dot products", lambda: build.bf16_dot_available(),
                 "a CPU with AVX512_BF16 where the panel kernel builds"),
    "fp16-dot": ("float16 products", lambda: build.fp16_dot_available(),
                 "a CPU with AVX512_FP16 where the panel kernel builds"),
    "q4_1": ("Q4_1 weights", lambda: build.blocks_available(),
             "a CPU with AVX512_VNNI, or AVX2 with F16C, where the panel kernel builds"),
    "q8_0": ("Q8_0 weights", lambda: build.blocks_available(),
             "a CPU with AVX512_VNNI, or AVX2 with F16C, where the panel kernel builds"),
}


@dataclass
class Engine:
    """A model plus the KV caches of the sequences it serves, keyed by sequence id."""

    model: torch.nn.Module
    max_sequences: int = 256
    max_context: int | None = None
    max_cache_bytes: int | None = None  # KV pool budget; None: bounded only by max_sequences × max_context
    sequences: dict[str, SequenceCache] = field(default_factory=dict)
    sequences_created: int = 0  # since start: how many sequences were ever placed here
    # One call at a time on one model: `run` holds it around every call.
    lock: threading.RLock = field(default_factory=threading.RLock)
    # Forwards always run on this one thread (specbatch/engine/model_thread.py says why).
    model_thread: ModelThread = field(default_factory=ModelThread)
    # Which forward runs the model: "specbatch" (the engine's own, weights prepacked:
    # specbatch.models.llama for Llama-family models and the EAGLE draft, specbatch.models.opt for OPT; see
    # OWN_FORWARDS), "transformers" (the model's own forward, any model), or "auto": the own one
    # where it covers the model, else transformers. After start-up it names the one in use.
    implementation: str = "auto"
    # The own forward's weight form on the CPU kernels (None: the model's weights as loaded):
    # "bf16" (weights rounded to bfloat16, float32 arithmetic), "bf16-dot" (inputs rounded too,
    # pairs summed on AVX512_BF16), "fp16-dot" (float16 weights and inputs, AVX512_FP16), "q4_1"
    # (the GGUF's own 4-bit blocks; Llama only) and "q8_0" (8-bit blocks: the embedded draft's).
    # All are row-exact: a target running one speculates exactly against its own target-only
    # decoding.
    weights: str | None = None
    # Keys and values kept in bfloat16 (rounded to nearest as they are written; attention widens
    # them back and computes in float32): the own Llama forward in float32 on the engine's CPU
    # kernels (build.available). From batch 8 on a step reads its cached keys and values from
    # memory, and they outweigh the weights at 32 sequences of 300 tokens; this halves those bytes
    # and the pool's memory. The model's numbers move (as a bf16 model's own cache rounds them);
    # speculation stays exact against target-only decoding with the same setting
    # (docs/decisions/kv-bf16.md).
    kv_bf16: bool = False
    # Calls of at least ``wide_from_rows`` rows (sequences x tokens fed) run on ``wide_threads``
    # threads where the layers run in one C call (llama.LlamaForward), the rest on the process's
    # thread count; 0: every call on it. The kernels' results do not depend on the thread count,
    # so neither does the output.
    wide_threads: int = 0
    wide_from_rows: int = 12
    clock: Callable[[], float] = time.monotonic  # for sequence leases (``reclaim_idle``); tests pass their own
    # Steps at bucketed static shapes, replayed as CUDA graphs (specbatch.engine.captured): "auto" (on for
    # CUDA with the own forward), "on" (captured at start-up), "lazy", "static" (padded, no
    # capture: any device), "off". After start-up it names the mode in use.
    captured_steps: str = "auto"

    def _check_weights(self, own) -> None:
        """Refuse a weight form the forward, the device, the dtype or the CPU cannot run."""
        if self.weights is None:
            return
        if self.weights not in WEIGHT_FORMS:
            raise ValueError(f"unknown weight form {self.weights!r}: one of {', '.join(WEIGHT_FORMS)}")
        described, available, where = WEIGHT_FORMS[self.weights]
        llama_only = self.weights == "q4_1"  # the GGUF's blocks are the Llama layers'
        if (own is None or (llama_only and own is not llama.LlamaForward) or self.device.type != "cpu"
                or self.dtype != torch.float32 or not available()):
            raise ValueError(f"{described} need the engine's own {'Llama ' if llama_only else ''}forward, in float32 "
                             f"on {where} ({build.unavailable_reason() or 'it does'})")

    def __post_init__(self):
        self.model.eval()
        config = self.model.config
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.hidden_size = config.hidden_size
        # A draft that reads target features: their size, and its output head's token ids.
        self.feature_size = config.feature_size if reads_target_features(self.model) else 0
        self.output_token_ids = getattr(self.model, "draft_to_target", None)
        self.max_context = self.max_context or getattr(config, "max_position_embeddings", None) or 2048
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_shape = self.run(self._probe_kv_shape)
        if self.implementation not in ("auto", "specbatch", "transformers"):
            raise ValueError(f"unknown forward implementation {self.implementation!r}")
        own = own_forward(self.model) if self.implementation != "transformers" else None
        if self.implementation == "specbatch" and own is None:
            raise ValueError(f"the engine's own forward does not cover {type(self.model).__name__}: "
                             "use implementation 'transformers' or 'auto'")
        self._check_weights(own)
        # The forward of one ragged batch (see RaggedBatch); LlamaForward.__call__ is the contract.
        self.forward = own(self.model, weights=self.weights) if own else TransformersForward(self.model)
        # The own Llama forward on the CPU kernels: a row's result never depends on the other rows of
        # a call, so a call may run as several forwards (by_length) with the same results.
        self.rows_independent = bool(getattr(self.forward, "native_attention", False))
        if self.kv_bf16 and not getattr(self.forward, "native_attention", False):
            raise ValueError("bf16 keys and values need the engine's own Llama forward in float32 on a CPU where its "
                             f"kernels build ({build.unavailable_reason() or 'they do'})")
        self.pool = KVPool(self.kv_shape, torch.bfloat16 if self.kv_bf16 else self.dtype, self.device,
                           self.max_cache_bytes)
        if self.wide_threads < 0 or self.wide_from_rows < 1:
            raise ValueError("wide_threads must be 0 (off) or more, wide_from_rows 1 or more")
        if self.wide_threads and isinstance(self.forward, llama.LlamaForward):
            self.forward.wide_threads, self.forward.wide_from_rows = self.wide_threads, self.wide_from_rows
        self.implementation = "specbatch" if own else "transformers"
        self.captured_steps = resolve_mode(self.captured_steps, self.device, own is not None)
        if self.kv_bf16 and self.captured_steps != "off":
            raise ValueError("bf16 keys and values run on the CPU kernels; captured steps are for CUDA")
        self.capture_report: dict = {}
        if self.captured_steps != "off":  # the pool must stay where the graphs point
            self.rows_independent = False  # captured calls run at their buckets' shapes
            self.pool.fix(self.max_sequences, self.max_context + 1)
            self.forward = CapturedForward(self.forward, self.pool, self.captured_steps, self.feature_size)
            if self.captured_steps == "on":
                self.capture_report = self.run(self.forward.capture_all)
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError("models with sliding-window attention layers are not supported yet")

    def run(self, fn, *args, **kwargs):
        """Call ``fn`` on the model thread, one call at a time (see ``model_thread``)."""

        def locked():
            with self.lock:
                before = set(self.sequences)
                try:
                    return fn(*args, **kwargs)
                except BaseException:
                    # A failed call leaves no sequence behind: one it created would hold a slot
                    # that nobody owns (its caller saw only the failure).
                    self.release([seq_id for seq_id in self.sequences if seq_id not in before])
                    raise

        if self.model_thread.on_thread():  # a call this thread read itself (ModelThread.watch)
            return locked()
        return self.model_thread.submit(locked).result()

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

    def _new_cache(self) -> SequenceCache:
        used = {cache.slot for cache in self.sequences.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        return SequenceCache(self.pool, slot)

    def check_rollback(self, seq_id: str, length: int) -> SequenceCache:
        """Refuse a rollback that ``rollback`` would refuse, changing nothing."""
        cache = self._get(seq_id)
        if not 0 <= length <= cache.length:
            raise InvalidRequest(f"sequence {seq_id!r} holds {cache.length} tokens; cannot roll back to {length}")
        return cache

    def rollback(self, seq_id: str, length: int) -> int:
        """Roll a sequence back to its first ``length`` tokens: O(1), the columns past it are
        masked and later overwritten. Every call does this for each of its sequences, to the
        ``keep_len`` it names (RaggedBatch); the Rollback RPC does it alone."""
        cache = self.check_rollback(seq_id, length)
        cache.length, cache.last_used = length, self.clock()
        return length

    def reclaim_idle(self, max_idle: float) -> list[str]:
        """Release the sequences no call has touched for more than ``max_idle`` seconds (their
        caller is gone: a coordinator killed or stopped before it released them); their ids.
        Run it through ``run``, so it never lands inside a call. A caller that was only slow gets
        NOT_FOUND next time and rebuilds the sequence from its history."""
        idle_since = self.clock() - max_idle
        idle = [seq_id for seq_id, cache in self.sequences.items() if cache.last_used < idle_since]
        self.release(idle)
        return idle

    def release(self, seq_ids: list[str]) -> int:
        """Forget sequences; unknown ids are ignored so that release is idempotent.

        Freed slots are refilled from the top, so the live sequences keep holding the slots
        ``0 … n-1`` and a call over all of them stays a view of the pool.
        """
        released = sum(self.sequences.pop(seq_id, None) is not None for seq_id in set(seq_ids))
        by_slot = sorted(self.sequences.values(), key=lambda cache: cache.slot)
        for target, cache in enumerate(by_slot):
            if cache.slot != target:
                self.pool.move(cache.slot, target, cache.length)
                cache.slot = target
        return released

    # ---- batched calls --------------------------------------------------------------------------

    def check_bounds(self, inputs: list[SequenceInput]) -> None:
        """What a call may ask of this engine whatever it holds: checked before the call waits for
        the model (the servicers call it first), so an oversized call is refused at once, and
        again in ``validate``. Per sequence, not per token: it stays cheap for any call."""
        if not inputs:
            raise InvalidRequest("a call needs at least one sequence")
        if len(inputs) > self.max_sequences:  # (as a call that would create too many: a capacity refusal)
            raise CapacityExceeded(f"{len(inputs)} sequences in one call; the limit is {self.max_sequences}")
        for item in inputs:
            if not item.seq_id:
                raise InvalidRequest("sequence id must not be empty")
            if len(item.seq_id) > MAX_SEQ_ID_LENGTH:
                raise InvalidRequest(f"a sequence id of {len(item.seq_id)} characters: the limit is {MAX_SEQ_ID_LENGTH}")
            if not 0 <= item.keep_len or item.keep_len + len(item.tokens) > self.max_context:
                raise InvalidRequest(f"sequence {item.seq_id!r} would reach {item.keep_len + len(item.tokens)} tokens, "
                                     f"over the model's context of {self.max_context}")
            if not item.tokens:
                raise InvalidRequest(f"sequence {item.seq_id!r}: no new tokens to feed")
            if self.feature_size and (item.features is None or tuple(item.features.shape) != (len(item.tokens), self.feature_size)):
                raise InvalidRequest(f"sequence {item.seq_id!r}: this draft reads one target feature of size "
                                     f"{self.feature_size} per token; got {None if item.features is None else tuple(item.features.shape)}")

    def validate(self, inputs: list[SequenceInput], extra_tokens: list[int], create: bool) -> None:
        """Check a whole call before touching any state, so a bad call changes nothing."""
        self.check_bounds(inputs)
        seen: set[str] = set()
        new = 0
        for item, extra in zip(inputs, extra_tokens):
            if item.seq_id in seen:
                raise InvalidRequest(f"sequence id {item.seq_id!r} appears twice in one call")
            seen.add(item.seq_id)
            cache = self.sequences.get(item.seq_id)
            if cache is None:
                if not create:
                    raise UnknownSequence(f"unknown sequence id {item.seq_id!r}")
                if item.keep_len:  # the caller believes it is cached: it is lost here (a restart, a lease)
                    raise UnknownSequence(f"unknown sequence id {item.seq_id!r}: send it with keep_len 0 to create it")
                new += 1
            elif item.keep_len > cache.length:
                raise StaleCache(
                    f"sequence {item.seq_id!r} holds {cache.length} tokens here, fewer than keep_len={item.keep_len}"
                )
            if item.parents is not None and (len(item.parents) != len(item.tokens) or item.parents[:1] != [-1] or any(
                    not -1 <= parent < j for j, parent in enumerate(item.parents))):
                raise InvalidRequest(f"sequence {item.seq_id!r}: a tree needs one parent per token, the first -1, "
                                     "each before its child")
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
        created = [item.seq_id for item in inputs if item.seq_id not in self.sequences]
        for seq_id in created:
            self.sequences[seq_id] = self._new_cache()
        now = self.clock()
        for item in inputs:
            self.sequences[item.seq_id].last_used = now
        try:
            batch = RaggedBatch(self, inputs, decode_steps)
        except BaseException:
            self.release(created)  # a refused call leaves no trace
            raise
        self.sequences_created += len(created)
        return batch

    def cached_tokens(self) -> int:
        return sum(cache.length for cache in self.sequences.values())

    def by_length(self, inputs: list[SequenceInput], create: bool, run: Callable[[list[int]], list],
                  extra_tokens: list[int] | None = None) -> list | None:
        """A call whose sequences feed very different token counts, as forwards of similar ones:
        ``run(indices)`` for each group of ``length_groups``, its results (one a sequence) gathered
        in the call's order. None where the call is one forward (the caller runs it whole): always
        unless the engine runs its CPU kernels, whose results for a row do not depend on the other
        rows of a call, so the outputs are the same either way. Before any group runs, the whole
        call is validated and its new sequences created in its order (later calls in that order
        find their slots in it); they are released should a forward fail. ``extra_tokens``: as
        ``start``'s, the tokens each sequence will decode after its fed ones."""
        groups = length_groups([len(item.tokens) for item in inputs], self.rows_independent)
        if len(groups) <= 1:
            return None
        self.validate(inputs, extra_tokens or [0] * len(inputs), create)
        created = [item.seq_id for item in inputs if item.seq_id not in self.sequences]
        for seq_id in created:
            self.sequences[seq_id] = self._new_cache()
        self.sequences_created += len(created)
        results: list = [None] * len(inputs)
        try:
            for group in groups:
                for i, result in zip(group, run(group)):
                    results[i] = result
        except BaseException:
            self.release([seq_id for seq_id in created if seq_id in self.sequences])  # none half made
            raise
        return results

    def catch_up(self, inputs: list[SequenceInput], extra_tokens: list[int]) -> list[SequenceInput]:
        """Where steps are captured: a call's rows that are wider than every bucket (a new prompt
        in a draft's Propose, a draft that fell behind) first prefill all but their last tokens,
        in a forward of their own, so the call itself stays captured; it returns the call's
        inputs with those rows cut to what is left (as many tokens as the call's other rows
        feed). One such row made every forward of a Propose eager, several times slower
        (docs/decisions/captured-steps.md). Elsewhere (and where no row is that wide) the
        inputs come back as they are. The whole call is validated first, so a call refused
        changes nothing."""
        widest = getattr(self.forward, "widest", None)
        if widest is None or all(len(item.tokens) <= widest for item in inputs):
            return inputs
        self.validate(inputs, extra_tokens, create=True)
        left = max((len(item.tokens) for item in inputs if len(item.tokens) <= widest), default=1)
        wide = [item for item in inputs if len(item.tokens) > widest]
        self.prefill([SequenceInput(item.seq_id, item.keep_len, item.tokens[:-left],
                                    None if item.features is None else item.features[:-left]) for item in wide])
        return [item if len(item.tokens) <= widest else
                SequenceInput(item.seq_id, item.keep_len + len(item.tokens) - left, item.tokens[-left:],
                              None if item.features is None else item.features[-left:])
                for item in inputs]

    def prefill(self, inputs: list[SequenceInput]) -> list[int]:
        """Add or extend sequences: cache all their tokens. Returns each one's cached length.
        Sequences of very different lengths run in forwards of similar ones (``by_length``): 32
        ShareGPT prompts (31-219 tokens, 60 on average) were two thirds padding in one
        (docs/decisions/prefill-by-length.md)."""

        def run(group) -> list[int]:
            items = [inputs[i] for i in group]
            batch = self.start(items, create=True)
            batch.prefill(1)
            batch.commit([len(item.tokens) for item in items])
            return [item.keep_len + len(item.tokens) for item in items]

        return self.by_length(inputs, True, run) or run(range(len(inputs)))

"""Captured steps: an engine's forward at bucketed static shapes, replayed as CUDA graphs.

A decode or verify step of a large model on a GPU is bound by the host launching ~1,100 small
kernels, not by the GPU's own work (docs/gpu.md). A CUDA graph records the kernels of one forward
at fixed shapes and addresses once, and replays them with one launch.

``CapturedForward`` wraps an engine's own forward (anything with ``LlamaForward.__call__``'s
contract). A call that fits a bucket of ``Buckets`` (batch size × tokens per row × attended
columns), whose KV is the pool view starting at slot 0 (the coordinator sends the whole running
batch; slots are dense), is padded into static buffers and replayed; any other call (a prefill of
long prompts, a gathered batch of non-contiguous slots, a batch larger than every bucket) runs the
wrapped forward eagerly. Padding:

- extra rows ``b … B-1`` are padding rows: all their tokens are padding, which write to the
  scratch column (the pool's last) and attend column 0 only. Those slots may hold live sequences
  that are not in this call: that is safe, since the scratch column is never part of a sequence
  and column 0 is only read;
- extra token columns are left padding (tokens are right-aligned, so the last columns of the
  logits stay the last);
- extra attended columns are masked off.

Only the tokens, their positions and columns, which of them are real, and which fed tokens each
one sees are copied in; the mask and the write columns are computed inside the captured region,
with RaggedBatch's semantics (each real token sees its row's cached columns and the fed tokens it
descends from, padding tokens see column 0 only). A chain's tokens sit at their positions and
see every fed token before them; a tree's (a verify call with leaves) sit at their depth and see
their ancestors only (``kv_pool.tree_mask``).

On CUDA the graphs share one memory pool; they are captured larger first, at start-up (mode
"on") or at a bucket's first use ("lazy"). The KV pool must not move after capture: the engine
allocates it once at its budget and refuses growth (``KVPool.fix``); should it move anyway, the
graphs are dropped and captured again. Mode "static" runs the same padded path eagerly without
capture, on any device: that is how CI on a CPU exercises the padding, bucketing and fallback."""

from __future__ import annotations

import logging
import time

import torch

from specbatch.engine.buckets import Buckets
from specbatch.engine.device import eager_attention, to_device
from specbatch.engine.kv_pool import KVPool, fed_visibility, tree_mask, write_columns_and_mask
from specbatch.protocol.speculation import MAX_K

log = logging.getLogger(__name__)


class CapturedForward:
    """``LlamaForward.__call__``'s contract over ``forward``, replayed at static shapes where a
    call fits (see the module docstring). ``replayed`` and ``eager`` count the calls of each
    path (a "static" call counts as replayed: it took the padded path)."""

    takes_host_inputs = True  # RaggedBatch hands over the tensors it built on the host (``__call__``)

    def __init__(self, forward, pool: KVPool, mode: str, feature_size: int = 0, max_width: int = MAX_K + 1):
        if mode not in ("on", "lazy", "static"):
            raise ValueError(f"CapturedForward runs modes on, lazy or static, not {mode!r}")
        self.forward, self.pool, self.mode = forward, pool, mode
        self.capture = mode != "static"
        if self.capture and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the pool is on {pool.device} (use mode 'static')")
        self.feature_size, self.max_width = feature_size, max_width
        self.replayed = 0
        self.eager_reasons: dict[str, int] = {}  # why calls ran eagerly: reason -> calls
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.report: dict = {}
        self._layout()

    # ---- static buffers ------------------------------------------------------------------------

    def _layout(self) -> None:
        """Buckets and static buffers for the pool as it is now (graphs are keyed on its address)."""
        self.graphs.clear()
        self.pool_address = self.pool.kv.data_ptr()
        self.buckets = Buckets.for_pool(self.pool.slots, self.pool.context, self.max_width)
        rows, width = self.buckets.batch[-1], self.buckets.width[-1]
        device = self.pool.device
        # Two flat tensors; a bucket of m = B×W tokens reads the first 3m integers (its tokens,
        # positions and columns, each [B, W]) and the first m + m×W flags (which tokens are real,
        # and which fed tokens each sees): so a call from the host fills its bucket with two copies
        # (``_fill_from_host``). Each graph keeps the addresses of its own bucket's views.
        n = rows * width
        self.ints = torch.zeros(3 * n, dtype=torch.long, device=device)
        self.flags = torch.zeros(n + n * width, dtype=torch.bool, device=device)
        self.features = (torch.zeros(rows * width * self.feature_size, dtype=self.pool.dtype, device=device)
                         if self.feature_size else None)
        self.logits = self.hidden = None  # outputs: allocated at the first static forward, when their sizes are known
        if self.capture:
            self.memory_pool = torch.cuda.graph_pool_handle()

    def _views(self, rows: int, width: int):
        n = rows * width
        features = None if self.features is None else self.features[: n * self.feature_size].view(rows, width, -1)
        return (self.ints[:n].view(rows, width), self.ints[n : 2 * n].view(rows, width),
                self.flags[:n].view(rows, width), features)

    def _tree_views(self, rows: int, width: int):
        n = rows * width
        return self.ints[2 * n : 3 * n].view(rows, width), self.flags[n : n + n * width].view(rows, width, width)

    def _static_forward(self, rows: int, width: int, end: int) -> None:
        """The forward at one bucket, from and into the static buffers: what a graph captures."""
        input_ids, positions, valid, features = self._views(rows, width)
        columns, sees = self._tree_views(rows, width)
        # RaggedBatch's columns and mask; padding rows and left padding are padding tokens.
        columns, mask = write_columns_and_mask(columns, valid, self.pool.context - 1, end)
        mask = tree_mask(mask, columns, valid, sees)
        logits, hidden = self.forward(input_ids, positions, columns, self.pool.kv[:, :, :rows], mask, width, features)
        if self.logits is None:
            self._outputs(logits.shape[-1], hidden.shape[-1], logits.dtype, hidden.dtype)
        self.logits[: rows * width * logits.shape[-1]].view(logits.shape).copy_(logits)
        self.hidden[: rows * width * hidden.shape[-1]].view(hidden.shape).copy_(hidden)

    def _outputs(self, vocab: int, hidden: int, logits_dtype, hidden_dtype) -> None:
        rows, width = self.buckets.batch[-1], self.buckets.width[-1]
        self.logits = torch.empty(rows * width * vocab, dtype=logits_dtype, device=self.pool.device)
        self.hidden = torch.empty(rows * width * hidden, dtype=hidden_dtype, device=self.pool.device)
        self.vocab, self.hidden_size = vocab, hidden

    # ---- capture ---------------------------------------------------------------------------------

    def _inputs(self) -> list[torch.Tensor]:
        return [t for t in (self.ints, self.flags, self.features)
                if t is not None]

    def _capture_one(self, bucket: tuple[int, int, int]) -> torch.cuda.CUDAGraph:
        rows, width, end = bucket
        self._views(rows, width)[2].zero_()  # all padding: writes only to the scratch column
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up off the capturing stream (allocator, cuBLAS workspaces)
                self._static_forward(rows, width, end)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.memory_pool):
            self._static_forward(rows, width, end)
        self.graphs[bucket] = graph
        return graph

    def capture_all(self) -> dict:
        """Capture every bucket, largest first; returns (and logs) what it took."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        started = time.perf_counter()
        for bucket in self.buckets.all():
            if bucket not in self.graphs:
                self._capture_one(bucket)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        self.report = {"graphs": len(self.graphs), "seconds": round(time.perf_counter() - started, 2),
                       "allocated_mib": round((after[0] - before[0]) / 2**20, 1),
                       "reserved_mib": round((after[1] - before[1]) / 2**20, 1),
                       "buckets": {"batch": list(self.buckets.batch), "width": list(self.buckets.width),
                                   "context": list(self.buckets.context)}}
        log.warning("captured %d CUDA graphs in %.1f s: +%.0f MiB allocated, +%.0f MiB reserved; buckets: batch %s, "
                    "tokens %s, columns %s", self.report["graphs"], self.report["seconds"], self.report["allocated_mib"],
                    self.report["reserved_mib"], self.buckets.batch, self.buckets.width, self.buckets.context)
        return self.report

    # ---- calls -----------------------------------------------------------------------------------

    def _bucket(self, batch: int, width: int, end: int, kv: torch.Tensor, count: bool = True):
        """The bucket of a call of ``batch`` rows × ``width`` tokens attending ``end`` columns over
        ``kv``, or None where it must run eagerly (``count``: counted by reason in ``eager_reasons``)."""
        pool = self.pool.kv
        if pool.data_ptr() != self.pool_address:  # the pool moved: every graph points at the old one
            self._layout()
        bucket = self.buckets.bucket_for(batch, width, end)
        if not self._within_pool(bucket):
            past = [name for name, need, sizes in (("rows", batch, self.buckets.batch), ("tokens", width, self.buckets.width),
                                                   ("columns", end, self.buckets.context)) if need > sizes[-1]]
            return self._declined(f"{' and '.join(past) or 'size'} past every bucket", count)
        # The pool view from slot 0: the same storage, strides and columns as the pool.
        if kv.data_ptr() != pool.data_ptr() or kv.stride() != pool.stride() or kv.shape[4] != pool.shape[4]:
            return self._declined("rows not the pool's slots from 0", count)
        return bucket

    def _within_pool(self, bucket) -> bool:
        return bucket is not None and bucket[0] <= self.pool.slots and bucket[2] <= self.pool.context

    @property
    def eager(self) -> int:
        """Calls that ran eagerly, every reason together."""
        return sum(self.eager_reasons.values())

    @property
    def widest(self) -> int:
        """The most tokens a row of a replayed call may feed (``Engine.catch_up``)."""
        return self.buckets.width[-1]

    def fits(self, batch: int, width: int, end: int) -> bool:
        """Whether a call of ``batch`` rows from slot 0, ``width`` tokens each, attending ``end``
        columns, fits a bucket (``RaggedBatch`` spreads a call over the slots from 0 where it does)."""
        return self._within_pool(self.buckets.bucket_for(batch, width, end))

    def _declined(self, reason: str, count: bool) -> None:
        """An eager call, counted by why: a silent fallback costs a GPU step several times its
        captured time (docs/decisions/captured-steps.md), so the first of each kind is logged and
        the services export the counts."""
        if not count:
            return None
        if reason not in self.eager_reasons:
            log.warning("a call runs eagerly (not captured): %s; further ones are counted in "
                        "specbatch_captured_calls{path=\"eager\"}", reason)
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        return None

    def _run(self, bucket: tuple[int, int, int]) -> None:
        """The bucket's forward over the static buffers as they are: replayed, or eager ("static")."""
        if not self.capture:
            self._static_forward(*bucket)
            return
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self._capture_lazily(bucket)
        graph.replay()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, write_columns: torch.Tensor,
                 kv: torch.Tensor, mask: torch.Tensor, logits_to_keep: int,
                 features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As the wrapped forward, whose inputs may also come as the host built them (``RaggedBatch``
        hands them over so: ``takes_host_inputs``): then they reach the static buffers in two
        copies instead of five copies, five clears and the mask's trip to the device."""
        device = self.pool.device
        bucket = self._bucket(input_ids.shape[0], input_ids.shape[1], mask.shape[-1], kv)
        host = all(t.device.type == "cpu" for t in (input_ids, positions, write_columns, mask))
        if bucket is None or not host:
            input_ids, positions, write_columns, mask = (to_device(t, device)
                                                         for t in (input_ids, positions, write_columns, mask))
        if features is not None:
            features = to_device(features, device)
        if bucket is None:
            with eager_attention(device):
                return self.forward(input_ids, positions, write_columns, kv, mask, logits_to_keep, features)
        self.replayed += 1
        rows, width, end = bucket
        batch, fed = input_ids.shape
        if host:
            self._fill_from_host(rows, width, input_ids, positions, write_columns, mask, kv.shape[4] - 1)
        else:
            self._fill_on_device(rows, width, input_ids, positions, write_columns, mask, kv.shape[4] - 1)
        static_features = self._views(rows, width)[3]
        if static_features is not None:
            static_features.zero_()
            static_features[:batch, width - fed:] = features
        self._run(bucket)
        logits = self.logits[: rows * width * self.vocab].view(rows, width, self.vocab)
        hidden = self.hidden[: rows * width * self.hidden_size].view(rows, width, self.hidden_size)
        # Copies: the static outputs are overwritten by the next replay.
        keep = min(logits_to_keep, fed)  # as the eager forward: no more columns than the call has
        return logits[:batch, width - keep:].clone(), hidden[:batch, width - fed:].clone()

    def _fill_on_device(self, rows: int, width: int, input_ids, positions, write_columns, mask, scratch: int) -> None:
        """The call's tokens right-aligned in the bucket's columns, from device tensors: a real
        token never writes to the scratch column, a padding token always does."""
        batch, fed = input_ids.shape
        static_ids, static_positions, static_valid, _ = self._views(rows, width)
        static_columns, static_sees = self._tree_views(rows, width)
        for buffer in (static_ids, static_positions, static_columns, static_valid, static_sees):
            buffer.zero_()
        valid = write_columns != scratch
        static_ids[:batch, width - fed:] = input_ids
        static_positions[:batch, width - fed:] = positions
        static_columns[:batch, width - fed:] = write_columns
        static_valid[:batch, width - fed:] = valid
        static_sees[:batch, width - fed:, width - fed:] = fed_visibility(mask, write_columns, valid)

    def _fill_from_host(self, rows: int, width: int, input_ids, positions, write_columns, mask, scratch: int) -> None:
        """What ``_fill_on_device`` writes, built on the host and copied over: one copy for the
        bucket's integers, one for its flags, without waiting."""
        batch, fed = input_ids.shape
        n = rows * width
        ints = torch.zeros(3, rows, width, dtype=torch.long)
        flags = torch.zeros(n + n * width, dtype=torch.bool)
        valid = write_columns != scratch
        for plane, values in enumerate((input_ids, positions, write_columns)):
            ints[plane, :batch, width - fed:] = values
        flags[:n].view(rows, width)[:batch, width - fed:] = valid
        flags[n:].view(rows, width, width)[:batch, width - fed:, width - fed:] = fed_visibility(mask, write_columns, valid)
        cuda = self.pool.device.type == "cuda"
        for static, built in ((self.ints[: 3 * n], ints.view(-1)), (self.flags[: n + n * width], flags)):
            static.copy_(built.pin_memory() if cuda else built, non_blocking=cuda)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, end: int, kv: torch.Tensor,
               features: torch.Tensor | None = None,
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One real token per row: a draft's decode step, with a few device copies where
        ``__call__`` builds a 4D mask on the host, copies it over and refills five buffers (on a
        GPU that host work, not the graph, bounded a drafted token: docs/gpu.md).

        ``tokens`` and ``positions`` (each token's position, which is also its write column):
        ``[batch]`` on the device; ``end``: the largest position plus one, from the host (reading
        it from the device would wait for the GPU); ``features``: ``[batch, feature_size]`` or
        None. Returns the logits ``[batch, vocab]`` and the final hidden states ``[batch, hidden]``
        that ``__call__`` gives for the same call (the same bucket and graph, the same values in
        every buffer a real row reads), or None where the call fits no bucket (the caller then
        takes ``__call__``, which runs it eagerly). ``rows``: the tokens' rows of ``kv`` (on the
        device) where the call is spread over the slots from 0 (``RaggedBatch``), the others
        padding; None: rows 0 … batch - 1."""
        batch = tokens.shape[0]
        span = batch if rows is None else kv.shape[2]
        bucket = self._bucket(span, 1, end, kv, count=False)  # __call__ takes (and counts) the call then
        if bucket is None:
            return None
        self.replayed += 1
        static_ids, static_positions, static_valid, static_features = self._views(bucket[0], 1)
        static_columns, static_sees = self._tree_views(bucket[0], 1)
        # Padding rows as __call__ leaves them: token 0 at position 0, not real (so they write the
        # scratch column and see column 0 only); a single real token sees itself.
        real = slice(0, batch) if rows is None else rows
        for static in (static_ids, static_positions, static_valid):
            static.zero_()
        static_valid[real] = True
        static_ids[real, 0] = tokens
        static_positions[real, 0] = positions
        static_columns.copy_(static_positions)
        static_sees.copy_(static_valid[:, :, None])
        if static_features is not None:
            static_features.zero_()
            static_features[real, 0] = features
        self._run(bucket)
        logits = self.logits[: bucket[0] * self.vocab].view(bucket[0], self.vocab)
        hidden = self.hidden[: bucket[0] * self.hidden_size].view(bucket[0], self.hidden_size)
        return logits[real].clone(), hidden[real].clone()

    def _capture_lazily(self, bucket):
        # Capturing replaces the static inputs with padding: keep the call's and put them back.
        saved = [t.clone() for t in self._inputs()]
        started = time.perf_counter()
        graph = self._capture_one(bucket)
        for buffer, value in zip(self._inputs(), saved):
            buffer.copy_(value)
        log.info("captured the CUDA graph of bucket %s in %.2f s", bucket, time.perf_counter() - started)
        return graph

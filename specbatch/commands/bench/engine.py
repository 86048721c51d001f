"""``specbatch bench-engine``: what one engine step costs, beside what the memory allows.

Two tables, at a fixed context (``--context`` tokens cached per sequence):

- **verify**: ms of one ``target_service.verifier.verify`` call over batch size × tokens fed per
  sequence (1 = a plain decode step, k+1 = verifying k drafts);
- **draft**: ms per drafted token of one ``draft_service.proposer.proposals`` call over batch
  size × k (the call's time / k).

Every sequence is prefilled once to the context; each timed call keeps exactly that many cached
tokens (``keep_len``), so whatever the previous call cached is rolled back and every repeat
sees the same context. A cell's time is the median of ``--repeats`` calls after ``--warmup``
unmeasured ones; on CUDA the device is synchronised before and after each call.

Beside each time, its **bandwidth limit**: the bytes a forward must read (every weight once,
except an input embedding that is not also the output head, of which only a few rows are read;
plus the keys and values of every cached and new token of every row) over ``--bandwidth-gbs``.
A draft call of k tokens runs k forwards, so its limit per token is the mean of theirs.

On a CPU the engines are built as the model services build them: the weight forms the machine
decides (``--weights``, ``specbatch.kernels.forms``), keys and values in bf16 beside them, the draft
on the target's model thread (as a draft hosted in the target's process), half the cores a call
and every call wide on all of them, and the main thread, which loads the models, on one thread:
a second OpenMP team in the process makes libgomp cut every team's spin, which doubles a
one-row step (docs/cpu-kernels.md#threads-and-wide-calls).

Prompt token ids are a seeded pseudo-random draw below each model's vocabulary: step times do
not depend on the text, and random-weights shapes have no tokenizer of their own."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.proposer import ProposeItem, proposals
from specbatch.commands import results
from specbatch.commands.bench.engine_report import markdown
from specbatch.config.options import add_option
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from target_service.verifier import VerifyItem, verify

FORMAT = "specbatch-bench-engine"


VERSION = 1


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


DEFAULT_TOKENS = (1, 2, 4, 8)


DEFAULT_KS = (1, 2, 3, 4, 5, 6)


# Peak memory bandwidth in GB/s by device name, from the vendors' data sheets; the first match
# wins, so the more specific names come first.
GPU_BANDWIDTH_GBS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                     ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
                     ("L40S", 864.0), ("L4", 300.0), ("A10", 600.0), ("V100", 900.0))


# No data sheet to read on a CPU: a rough figure for a few DDR5 channels. Pass --bandwidth-gbs.
CPU_BANDWIDTH_GBS = 50.0


@dataclass
class Grid:
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    tokens: tuple[int, ...] = DEFAULT_TOKENS  # tokens fed per sequence in a verify call
    ks: tuple[int, ...] = DEFAULT_KS  # drafted tokens per sequence in a propose call
    context: int = 512
    repeats: int = 10
    warmup: int = 2


def default_bandwidth_gbs(device: torch.device) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from) for ``device``; None where the name is not known."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbs in GPU_BANDWIDTH_GBS:
            if key in name:
                return gbs, f"data sheet of {name}"
        return None, f"unknown for {name}: pass --bandwidth-gbs"
    return CPU_BANDWIDTH_GBS, "a rough CPU figure; pass --bandwidth-gbs for this machine's"


@dataclass(frozen=True)
class Traffic:
    """The bytes a forward of a model must read."""

    weight_bytes: int  # every weight read once per forward
    kv_bytes_per_token: int  # keys and values of one token, over all layers

    @classmethod
    def of(cls, engine: Engine) -> "Traffic":
        model = engine.model
        if engine.weights:  # a CPU kernel form: what its multiplies read, packed
            weights = sum(linear.panels.numel() * linear.panels.element_size() for linear in _panels(engine.forward))
        else:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: listed once
            embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
            if head is None or head.weight is not embedding:  # a lookup reads only the rows it needs
                weights -= embedding.numel() * embedding.element_size()
        layers, kv_heads, head_dim = engine.kv_shape
        return cls(weights, 2 * layers * kv_heads * head_dim * engine.pool.kv.element_size())

    def forward_bytes(self, batch: int, attended: float) -> float:
        """One forward of ``batch`` rows, each attending over ``attended`` tokens."""
        return self.weight_bytes + batch * attended * self.kv_bytes_per_token


def _panels(forward) -> list:
    """Every packed linear layer of an own forward (its layers', its head, a draft's fusing layer)."""
    from specbatch.kernels.panel import PanelLinear

    found: dict[int, PanelLinear] = {}

    def visit(value, depth: int) -> None:
        if isinstance(value, PanelLinear):
            found[id(value)] = value
        elif isinstance(value, (list, tuple)) and depth < 3:
            for item in value:
                visit(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor)) and depth < 3:
            for item in vars(value).values():
                visit(item, depth + 1)

    visit(forward, 0)
    return list(found.values())


def limit_ms(nbytes: float, bandwidth_gbs: float | None) -> float | None:
    return None if not bandwidth_gbs else nbytes / (bandwidth_gbs * 1e9) * 1e3


class Bench:
    """One engine with ``max(batch_sizes)`` sequences prefilled to the grid's context."""

    def __init__(self, engine: Engine, grid: Grid, seed: int = 0):
        self.engine, self.grid = engine, grid
        generator = torch.Generator().manual_seed(seed)
        count = max(grid.batch_sizes)
        # Context tokens plus one more per sequence: the first token fed by every timed call.
        self.tokens = torch.randint(0, engine.vocab_size, (count, grid.context + 1), generator=generator).tolist()
        self.ids = [f"bench-{i}" for i in range(count)]
        self.device = engine.device
        # Chunks of about 8192 prefilled tokens bound the activations of the prefill.
        chunk = max(1, 8192 // max(grid.context, 1))
        for first in range(0, count, chunk):
            engine.run(engine.prefill, [SequenceInput(i, 0, t[: grid.context], self._features(grid.context))
                                        for i, t in zip(self.ids[first:first + chunk], self.tokens[first:first + chunk])])

    def _features(self, n: int) -> torch.Tensor | None:
        # A draft that reads target features gets zeros: the cost of a forward does not depend on them.
        size = self.engine.feature_size
        return torch.zeros(n, size) if size else None

    def _next(self, i: int) -> SequenceInput:
        """Sequence i's next call: keep exactly the context, feed the token after it."""
        return SequenceInput(self.ids[i], self.grid.context, [self.tokens[i][-1]], self._features(1))

    def _median_ms(self, call) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *_: None)

        def once() -> float:
            sync(self.device)
            start = time.perf_counter()
            call()
            sync(self.device)
            return 1e3 * (time.perf_counter() - start)

        times = [self.engine.run(once) for _ in range(self.grid.warmup + self.grid.repeats)]
        return statistics.median(times[self.grid.warmup:])

    def verify_ms(self, batch: int, tokens: int) -> float:
        """One verify call: per sequence the next token and ``tokens - 1`` drafts (greedy)."""
        drafts = [self.tokens[i][:tokens - 1] for i in range(batch)]
        items = [VerifyItem(self._next(i), drafts[i]) for i in range(batch)]
        return self._median_ms(lambda: verify(self.engine, items))

    def propose_ms(self, batch: int, k: int) -> float:
        """One propose call of k drafted tokens per sequence (greedy)."""
        items = [ProposeItem(self._next(i), k) for i in range(batch)]
        return self._median_ms(lambda: proposals(self.engine, items))

    def close(self) -> None:
        self.engine.run(self.engine.release, list(self.ids))


def bench_engine(target: Engine, draft: Engine | None, grid: Grid, bandwidth_gbs: float | None,
                 progress=None) -> dict:
    """Every cell of the grid, measured, with its bandwidth limit (see the module docstring)."""
    result = {"verify": [], "draft": []}
    say = progress or (lambda text: None)
    bench = Bench(target, grid)
    traffic = Traffic.of(target)
    try:
        for b in grid.batch_sizes:
            for t in grid.tokens:
                ms = bench.verify_ms(b, t)
                bound = limit_ms(traffic.forward_bytes(b, grid.context + t), bandwidth_gbs)
                result["verify"].append({"batch_size": b, "tokens": t, "ms": round(ms, 3), "limit_ms": _round(bound)})
                say(f"verify batch {b:>3} × {t} tokens: {ms:8.2f} ms")
    finally:
        bench.close()
    if draft is not None:
        bench, traffic = Bench(draft, grid), Traffic.of(draft)
        try:
            for b in grid.batch_sizes:
                for k in grid.ks:
                    ms = bench.propose_ms(b, k)
                    # Forward i of k attends over context + i tokens: the mean is context + (k + 1) / 2.
                    bound = limit_ms(traffic.forward_bytes(b, grid.context + (k + 1) / 2), bandwidth_gbs)
                    result["draft"].append({"batch_size": b, "k": k, "ms": round(ms, 3),
                                            "ms_per_token": round(ms / k, 3), "limit_ms_per_token": _round(bound)})
                    say(f"draft  batch {b:>3} × k={k}: {ms / k:8.2f} ms per drafted token")
        finally:
            bench.close()
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers (got {text!r})") from None
    if not values or values != tuple(sorted(set(values))) or values[0] < 1:
        raise ValueError(f"{flag} must be increasing positive integers (got {text!r})")
    return values


def add_bench_engine_flags(parser) -> None:
    from specbatch.models.embedded import EMBEDDED

    parser.add_argument("--target-model", default=EMBEDDED, help=f"HF hub id or folder, or with --random-weights a "
                        f"shape: opt-6.7b, opt-125m, llama-3-8b, llama-3.2-1b, llama-3-8b-eagle, smollm2-135m or a "
                        f"config folder (default {EMBEDDED})")
    parser.add_argument("--draft-model", help="the draft to time (default: none, verify only)")
    parser.add_argument("--draft-layers", type=int, help="keep only the draft's first N layers")
    parser.add_argument("--random-weights", action="store_true", help="only the models' shapes, random weights")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 … (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (default: bfloat16 on GPU, float32 on CPU)")
    # The pool is allocated as the grid needs it (with captured steps: once, for the largest batch
    # at the longest call), never beyond: a generous default only keeps the default grid whole
    # (batch 64 × 520 tokens of OPT-6.7B is 16.3 GiB).
    parser.add_argument("--kv-cache-gb", type=float, default=32.0,
                        help="KV budget of each model in GiB (default 32); batch sizes that do not fit are skipped")
    add_option(parser, "cuda_graphs")
    add_option(parser, "weights")
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens fed per sequence in a verify step")
    parser.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="drafted tokens per sequence in a propose call")
    parser.add_argument("--context", type=int, default=512, help="tokens cached per sequence (default 512)")
    parser.add_argument("--repeats", type=int, default=10, help="measured calls per cell (median)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured calls before them")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the limits (default: the GPU's "
                        f"data sheet by name; {CPU_BANDWIDTH_GBS:g} on CPU)")
    parser.add_argument("--out", help="a folder to write bench-engine.json and bench-engine.md to (default: only the "
                        "result, benchmarks/results/<machine>/bench-engine.json)")
    results.add_output_flags(parser, "bench-engine", out=False)


def _fitting(sizes: tuple[int, ...], need_per_sequence: int, budget: int) -> tuple[tuple[int, ...], list[int]]:
    fits = tuple(b for b in sizes if b * need_per_sequence <= budget)
    return fits, [b for b in sizes if b not in fits]


def run_bench_engine(args) -> int:
    before = torch.get_num_threads()  # set as the services run on a CPU; the caller's, after
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args) -> int:
    from specbatch.commands.profiler import describe_hardware
    from specbatch.kernels import forms
    from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
    from specbatch.models.loading import ModelSpec, default_device, load_model
    from specbatch.stack.defaults import available_cores

    try:
        grid = Grid(_sizes(args.batch_sizes, "--batch-sizes"), _sizes(args.tokens, "--tokens"), _sizes(args.ks, "--ks"),
                    args.context, args.repeats, args.warmup)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    if grid.context < 1 or grid.repeats < 1 or grid.warmup < 0:
        print("--context and --repeats must be positive, --warmup not negative", file=sys.stderr)
        return 2
    device = args.device or default_device()
    budget = int(args.kv_cache_gb * 2**30)
    longest = grid.context + max(max(grid.tokens), max(grid.ks))  # the most a timed call reaches
    on_cpu = device == "cpu"
    embedded = (args.target_model == EMBEDDED and args.draft_model in (None, EMBEDDED_DRAFT)
                and not (args.random_weights or args.draft_layers))
    problem = forms.problem(args.weights, device, args.dtype) if args.weights != "auto" else None
    if problem:
        print(problem, file=sys.stderr)
        return 2
    chosen = forms.decide(args.weights, embedded, device, args.dtype)
    if on_cpu:  # as the services run (the module docstring)
        torch.set_num_threads(max(1, available_cores() // 2))

    def engine_for(spec: ModelSpec, form: str, **shared) -> Engine:
        started = time.perf_counter()
        model = load_model(spec, device, forms.dtype_for(form, args.dtype))
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions and longest > positions:
            raise ValueError(f"{spec.describe()} takes {positions} positions; --context {grid.context} with "
                             f"{longest - grid.context} more tokens needs {longest}")
        engine = Engine(model, max_sequences=max(grid.batch_sizes), max_context=longest,
                        max_cache_bytes=budget, captured_steps=args.cuda_graphs,
                        **forms.engine_options(form, device), wide_threads=available_cores() if on_cpu else 0,
                        wide_from_rows=1, **shared)
        print(f"loaded {spec.describe()} in {time.perf_counter() - started:.1f}s on {engine.device}/{engine.dtype}, "
              f"weights {engine.weights or 'as loaded'}, captured steps {engine.captured_steps}", file=sys.stderr,
              flush=True)
        if engine.capture_report:
            print(f"captured {spec.describe()}: {json.dumps(engine.capture_report)}", file=sys.stderr, flush=True)
        return engine

    try:
        target = engine_for(ModelSpec(args.target_model, random_weights=args.random_weights), chosen.target)
        draft = None
        if args.draft_model:
            draft = engine_for(ModelSpec(args.draft_model, num_layers=args.draft_layers,
                                         random_weights=args.random_weights), chosen.draft,
                               **({"model_thread": target.model_thread, "lock": target.lock} if on_cpu else {}))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    # The pool holds every slot at the longest call's length plus a scratch column.
    skipped = set()
    for engine in filter(None, (target, draft)):
        per_sequence = engine.pool.bytes_for(1, longest + 1)
        skipped |= set(_fitting(grid.batch_sizes, per_sequence, budget)[1])
    if skipped:
        print(f"batch sizes {sorted(skipped)} do not fit --kv-cache-gb {args.kv_cache_gb:g} at context "
              f"{grid.context}: skipped", file=sys.stderr)
        grid.batch_sizes = tuple(b for b in grid.batch_sizes if b not in skipped)
        if not grid.batch_sizes:
            return 2
    bandwidth, source = ((args.bandwidth_gbs, "--bandwidth-gbs") if args.bandwidth_gbs
                         else default_bandwidth_gbs(target.device))
    started = time.perf_counter()
    cells = bench_engine(target, draft, grid, bandwidth,
                         progress=lambda text: print(text, file=sys.stderr, flush=True))

    def about(engine: Engine, name: str) -> dict:
        traffic = Traffic.of(engine)
        return {"model": name, "dtype": str(engine.dtype).removeprefix("torch."), "weights": engine.weights or "model",
                "random_weights": args.random_weights,
                "parameters": sum(p.numel() for p in engine.model.parameters()),
                "weight_bytes_read": traffic.weight_bytes, "kv_bytes_per_token": traffic.kv_bytes_per_token,
                "captured_steps": engine.captured_steps, "capture": engine.capture_report or None}

    report = {
        "format": FORMAT, "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": describe_hardware(str(target.device)),
        "target": about(target, ModelSpec(args.target_model, random_weights=args.random_weights).describe()),
        "draft_model": about(draft, ModelSpec(args.draft_model, num_layers=args.draft_layers,
                                              random_weights=args.random_weights).describe()) if draft else None,
        "grid": {"batch_sizes": list(grid.batch_sizes), "tokens": list(grid.tokens),
                 "ks": list(grid.ks) if draft else [], "context": grid.context, "repeats": grid.repeats,
                 "warmup": grid.warmup},
        "skipped_batch_sizes": sorted(skipped),
        "bandwidth_gbs": bandwidth, "bandwidth_source": source,
        "prompts": "seeded random token ids below each model's vocabulary",
        "seconds": round(time.perf_counter() - started, 1),
        **cells,
    }
    text = markdown(report)
    print(text)
    if not args.out:
        results.write("bench-engine", report, variant=args.variant, device=str(target.device))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results.write("bench-engine", report, out=out / "bench-engine.json", variant=args.variant,
                  device=str(target.device))
    (out / "bench-engine.md").write_text(text + "\n")
    print(f"wrote {out / 'bench-engine.md'}", file=sys.stderr)
    return 0

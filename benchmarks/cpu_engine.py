"""The target's verify step on this CPU: the engine's dtypes and linear layers side by side.

Times ``target_service.verifier.verify`` (what the target service runs per step) on the embedded
SmolLM2-135M at context 128, median of repeats, for batch × new tokens per sequence, with:
- ``fp32-transformers``: float32 through transformers' forward (the engine before its own);
- ``fp32-specbatch-mkl``: float32 through the engine's own forward (specbatch.models.llama), its linear
  layers on ``F.linear`` (MKL), as before oneDNN took float32 too;
- ``fp32-specbatch-onednn``: the same with oneDNN-reordered float32 weights (the fallback where
  the engine's own kernel cannot be built; the default before it);
- ``fp32-specbatch``: the same on the engine's own float32 kernel (``specbatch.kernels.build``);
- ``fp32-bf16w-specbatch``: float32 with the weights read as bf16 on that kernel (the embedded
  services' default where the kernel builds and the CPU lacks AVX512_BF16);
- ``fp32-bf16dot-specbatch`` (CPUs with AVX512_BF16): the linear layers' inputs rounded to bf16
  too, pairs' products summed in float32, keys and values kept in bf16 (the embedded services'
  default there without AVX512_FP16);
- ``fp32-fp16dot-specbatch`` (CPUs with AVX512_FP16): weights and inputs in float16, products
  summed in float16 in runs of 32, keys and values in bf16 (the embedded services' default there);
- ``fp32-q4_1-specbatch`` (CPUs with AVX512_BF16): as ``fp32-bf16dot-specbatch`` with the decoder
  layers' weights in the GGUF's own Q4_1 blocks (``specbatch.kernels.gguf_blocks``; the head stays bf16);
- ``bf16-specbatch`` (only on CPUs with native bf16, where ``--dtype auto`` picks it): bf16 with
  oneDNN-prepacked weights;
Then the ratios set as the engine's targets, for the engine the embedded services run here,
and where its steps' time goes (batch 1 × 1, 8 × 1, 8 × 4: the matrix multiplies at 32 rows are
what limit the batch-8 ratio).

    .venv/bin/python benchmarks/cpu_engine.py [--threads 2] [--repeats 20]

Writes the result to benchmarks/results/<machine>/cpu-engine.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from specbatch.commands import results
from specbatch.commands.bench.engine import Bench, Grid
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.kernels import build
from specbatch.kernels import layers as kernel_layers
from specbatch.kernels.layers import Attention, DecoderLayers, Rope
from specbatch.kernels.linear import onednn_bf16_available
from specbatch.kernels.panel import PanelLinear
from specbatch.models.loading import ModelSpec, load_model
from target_service.verifier import VerifyItem, verify

CONTEXT = 128
SHAPES = [(1, 1), (1, 2), (1, 4), (1, 5), (1, 6), (8, 1), (8, 2), (8, 4), (32, 1), (32, 2)]


def time_split(engine: Engine, batch: int, new: int, repeats: int = 10) -> dict:
    """Where a verify step's time goes (``batch`` sequences × ``new`` tokens at context CONTEXT):
    matrix multiplies, attention, other operators, and the rest (Python between operators), from
    the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    ids = [f"split{row}" for row in range(batch)]
    engine.prefill([SequenceInput(seq_id, 0, list(range(100, 100 + CONTEXT))) for seq_id in ids])
    items = [VerifyItem(SequenceInput(seq_id, CONTEXT, [11] * new)) for seq_id in ids]
    for _ in range(3):
        verify(engine, items)
    start = time.perf_counter()
    # The engine's own kernels are C calls the profiler does not see: named here, while profiling.
    def named(function, name):
        def call(*args, **kwargs):
            with record_function(name):
                return function(*args, **kwargs)
        return call

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(PanelLinear, "multiply_at", named(PanelLinear.multiply_at, "panel_sgemm")))
        patches.enter_context(mock.patch.object(Attention, "__call__", named(Attention.__call__, "native_attention")))
        for layer_op in ("add_rms_norm", "silu_mul"):
            patches.enter_context(mock.patch.object(kernel_layers, layer_op, named(getattr(kernel_layers, layer_op), f"native_{layer_op}")))
        patches.enter_context(mock.patch.object(Rope, "__call__", named(Rope.__call__, "native_rope")))
        patches.enter_context(mock.patch.object(DecoderLayers, "__call__",
                                                named(DecoderLayers.__call__, "native_decoder_layers")))
        prof = patches.enter_context(profile(activities=[ProfilerActivity.CPU]))
        for _ in range(repeats):
            verify(engine, items)
    wall = (time.perf_counter() - start) / repeats * 1000
    engine.release(ids)
    split = {"matmul": 0.0, "attention": 0.0, "other operators": 0.0, "decoder layers, one C call": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / repeats
        if any(name in event.key for name in ("linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "panel_sgemm")):
            split["matmul"] += ms
        elif "scaled_dot_product" in event.key or "native_attention" in event.key:
            split["attention"] += ms
        elif "native_decoder_layers" in event.key:  # the layers in one C call: multiplies, attention and all
            split["decoder layers, one C call"] += ms
        else:
            split["other operators"] += ms
    split["Python and the rest"] = max(wall - sum(split.values()), 0.0)
    split["wall (under the profiler)"] = wall
    return split


SPLIT_SHAPES = [(1, 1), (8, 1), (8, 4)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    results.add_output_flags(parser, "cpu-engine")
    parser.add_argument("--engines", default="", help="comma-separated engine names to time (default: all); the "
                        "embedded form's name with '-python-loop' is that form with its layers called from Python")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fp32 = load_model(ModelSpec(), "cpu", torch.float32)
    engines = {"fp32-transformers": Engine(fp32, implementation="transformers")}
    with mock.patch("specbatch.kernels.linear.onednn_prepacks", lambda weight: False):
        engines["fp32-specbatch-mkl"] = Engine(fp32, implementation="specbatch")
    with mock.patch("specbatch.kernels.linear.panel_kernel_takes", lambda weight: False):
        engines["fp32-specbatch-onednn"] = Engine(fp32, implementation="specbatch")
    engines["fp32-specbatch"] = Engine(fp32, implementation="specbatch")
    if build.available():
        engines["fp32-bf16w-specbatch"] = Engine(fp32, weights="bf16")
    if build.bf16_dot_available():
        engines["fp32-bf16dot-specbatch"] = Engine(fp32, weights="bf16-dot", kv_bf16=True)
        # the decoder layers in the GGUF's own Q4_1 blocks, the head on bf16 dot products
        engines["fp32-q4_1-specbatch"] = Engine(fp32, weights="q4_1", kv_bf16=True)
    if build.fp16_dot_available():
        engines["fp32-fp16dot-specbatch"] = Engine(fp32, weights="fp16-dot", kv_bf16=True)
    # The embedded form with its decoder layers called one kernel at a time from Python, as before
    # they ran in one C call (specbatch/kernels/decoder.c): what that call saves.
    for name, engine in list(engines.items()):
        if name.startswith("fp32-") and "dot" in name:
            engines[f"{name}-python-loop"] = loop = Engine(fp32, weights=engine.weights, kv_bf16=True)
            loop.forward.decoder_layers = None
    native_bf16 = onednn_bf16_available()
    if native_bf16:  # without it bf16 multiplies are emulated: slower than fp32, and never picked
        bf16 = load_model(ModelSpec(), "cpu", torch.bfloat16)
        engines["bf16-specbatch"] = Engine(bf16)
    # what the embedded services run here (specbatch.kernels.forms.machine_target_form)
    best = next(name for name in ("fp32-fp16dot-specbatch", "fp32-bf16dot-specbatch", "fp32-bf16w-specbatch",
                                  "bf16-specbatch", "fp32-specbatch") if name in engines)
    if args.engines:
        chosen = set(args.engines.split(",")) | {best, "fp32-transformers"}  # the ratios' baselines stay
        engines = {name: engine for name, engine in engines.items() if name in chosen}
    # Each engine holds the largest batch at CONTEXT tokens; every timed verify keeps exactly
    # CONTEXT (the bench-engine command's timing). The engines take turns, a warm-up call and two
    # timed ones each, so the machine's drift lands on all of them alike (measured one after
    # another, drift alone moved a ratio by a quarter); a cell is the median of the turns' medians.
    grid = Grid(batch_sizes=(max(b for b, _ in SHAPES),), context=CONTEXT, repeats=2, warmup=1)
    benches = {name: Bench(engine, grid) for name, engine in engines.items()}
    table = {name: {} for name in engines}
    for batch, new in SHAPES:
        turns = {name: [] for name in benches}
        for _ in range(max(args.repeats // 2, 1)):
            for name, bench in benches.items():
                turns[name].append(bench.verify_ms(batch, new))
        for name in benches:
            table[name][f"{batch}x{new}"] = statistics.median(turns[name])
        print(f"batch {batch} x {new} new: " + ", ".join(f"{n} {t[f'{batch}x{new}']:.1f} ms" for n, t in table.items()),
              flush=True)

    print(f"\n## verify step, ms (SmolLM2-135M, context {CONTEXT}, {args.threads} threads, engines taking turns, "
          f"{max(args.repeats // 2, 1)} turns of 2 calls)\n")
    print("| batch × new tokens | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for batch, new in SHAPES:
        print(f"| {batch} × {new} | " + " | ".join(f"{table[n][f'{batch}x{new}']:.1f}" for n in engines) + " |")
    ratios = {
        f"one token at batch 1: fp32-transformers / {best} (target >= 1.4)":
            table["fp32-transformers"]["1x1"] / table[best]["1x1"],
        f"5 new tokens / 1 at batch 1, {best} (target <= 1.15)": table[best]["1x5"] / table[best]["1x1"],
        f"4 new tokens / 1 at batch 8, {best} (target <= 1.3)": table[best]["8x4"] / table[best]["8x1"],
    }
    for before in ("fp32-specbatch-onednn", "fp32-specbatch", "bf16-specbatch", f"{best}-python-loop"):
        if before in table and before != best:
            ratios[f"one token at batch 1: {before} / {best}"] = table[before]["1x1"] / table[best]["1x1"]
    q4 = "fp32-q4_1-specbatch"
    if q4 in table and q4 != best:
        for shape in ("1x1", "1x5", "8x1", "8x4"):
            ratios[f"{shape.replace('x', ' × ')}: {best} / {q4}"] = table[best][shape] / table[q4][shape]
    for before in ("fp32-transformers", "fp32-specbatch-mkl", "fp32-specbatch-onednn", "fp32-bf16dot-specbatch",
                   "fp32-q4_1-specbatch"):
        if before in table and before != best:
            ratios[f"5 new tokens / 1 at batch 1, {before}"] = table[before]["1x5"] / table[before]["1x1"]
    for other in ("fp32-bf16dot-specbatch", "fp32-q4_1-specbatch"):
        if other in table and other != best:
            ratios[f"4 new tokens / 1 at batch 8, {other}"] = table[other]["8x4"] / table[other]["8x1"]
    print("\n| ratio | measured |\n|---|---|")
    for name, value in ratios.items():
        print(f"| {name} | {value:.2f} |")
    for bench in benches.values():
        bench.close()
    # The batch-8 ratio's limit: at 8 × 4 every matrix multiply has 32 rows.
    splits = {f"{batch}x{new}": time_split(engines[best], batch, new) for batch, new in SPLIT_SHAPES}
    print(f"\n## where a {best} verify step goes (ms, under the profiler)\n")
    print("| part | " + " | ".join(f"{shape.replace('x', ' × ')}" for shape in splits) + " |")
    print("|---|" + "---|" * len(splits))
    for part in next(iter(splits.values())):
        print(f"| {part} | " + " | ".join(f"{split[part]:.1f}" for split in splits.values()) + " |")
    results.write("cpu-engine", {"embedded_form": best, "context": CONTEXT, "ms": table, "ratios": ratios,
                                 "split_ms": splits, "threads": args.threads},
                  out=args.out, variant=args.variant, device="cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

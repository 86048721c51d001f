#!/usr/bin/env python3
"""One layer's attention as the own forward calls it (``specbatch.models.llama.LlamaForward._sdpa``: the
query heads of a key/value head folded into one head, a boolean mask over the pool's columns),
timed under each of PyTorch's SDPA backends: attention is a visible share of a captured small
model's step on a GPU (docs/gpu.md), so is another backend cheaper at these shapes?

    python3 benchmarks/sdpa_backends.py [--device cuda] [--dtype bfloat16]

Prints µs per call (median of CUDA-event-timed calls after a warm-up) per shape and backend; a
backend that refuses a shape prints "-". Writes them to benchmarks/results/<machine>/sdpa-backends.json
(or ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specbatch.commands import results

# (name, kv heads, query heads per kv head, head dim): SmolLM2-135M and OPT-6.7B (no GQA).
MODELS = [("smollm2-135m", 3, 3, 64), ("opt-6.7b", 32, 1, 128)]
BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]


def time_us(call, device: str, repeats: int = 50) -> float:
    for _ in range(5):
        call()
    if not device.startswith("cuda"):
        import time
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(1e6 * (time.perf_counter() - start))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1x1x512,1x4x512,8x1x512,32x4x512",
                        help="batch x new tokens x attended columns, comma-separated")
    results.add_output_flags(parser, "sdpa-backends")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print("| model | batch × tokens × columns | " + " | ".join(name for name, _ in BACKENDS) + " |")
    print("|---|---|" + "---|" * len(BACKENDS))
    rows = []
    for model, kv_heads, groups, head_dim in MODELS:
        for shape in args.shapes.split(","):
            batch, width, columns = (int(v) for v in shape.split("x"))
            q = torch.randn(batch, kv_heads, groups * width, head_dim, device=args.device, dtype=dtype)
            k = torch.randn(batch, kv_heads, columns, head_dim, device=args.device, dtype=dtype)
            v = torch.randn_like(k)
            mask = torch.ones(batch, 1, groups * width, columns, device=args.device, dtype=torch.bool).tril(columns - width)
            cells = {}
            for name, backend in BACKENDS:
                try:
                    with sdpa_kernel(backend):
                        call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
                        cells[name] = time_us(call, args.device)
                except RuntimeError:
                    cells[name] = None  # the backend refuses this shape
            print(f"| {model} | {shape} | " + " | ".join("-" if us is None else f"{us:.1f}" for us in cells.values())
                  + " |", flush=True)
            rows.append({"model": model, "shape": shape, **{f"{name} µs": us for name, us in cells.items()}})
    results.write("sdpa-backends", {"dtype": args.dtype, "rows": rows}, out=args.out, variant=args.variant,
                  device=args.device)


if __name__ == "__main__":
    main()

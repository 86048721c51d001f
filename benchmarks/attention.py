"""Attention that reads only what each row needs (issue 16): ms per layer's attention at long
contexts, rows of different lengths, three ways in one run:

- ``dense``: one SDPA over the first ``end`` columns of every row (the longest row's end, or the
  captured step's context bucket, which is at most twice that) with the engine's 4D boolean mask:
  what ``specbatch.models.llama`` does today. Short rows read the long row's columns, masked;
- ``per row``: one SDPA per row over its own columns, no mask (reads exactly what each row needs,
  at one kernel launch per row);
- ``flex``: FlexAttention (``torch.nn.attention.flex_attention``, compiled) with a block mask
  built from the rows' lengths: one kernel that skips every block past a row's end. Left out
  where it does not compile on the device.

Rows' lengths are spread evenly from 1/8 of the longest to the longest (a mixed serving batch).
Each method's output is checked against ``per row`` before it is timed.

    .venv/bin/python benchmarks/attention.py --device cuda   # OPT-6.7B's attention shape (32 heads × 128)
    .venv/bin/python benchmarks/attention.py --device cpu    # SmolLM2's (9 query heads over 3, × 64), small grid
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"cuda": {"heads": 32, "kv_heads": 32, "head_dim": 128}, "cpu": {"heads": 9, "kv_heads": 3, "head_dim": 64}}
GRIDS = {"cuda": {"batch": (1, 8, 32), "longest": (512, 2048, 8192), "width": (1, 4)},
         "cpu": {"batch": (1, 8), "longest": (256, 1024), "width": (1, 4)}}


def lengths_for(batch: int, longest: int) -> list[int]:
    """Rows' lengths (new tokens included), evenly from longest/8 to longest."""
    low = max(1, longest // 8)
    return [longest] if batch == 1 else [low + (longest - low) * i // (batch - 1) for i in range(batch)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


class Case:
    """One batch of rows over a pool of ``longest`` columns, ``width`` new tokens a row (the last
    ones of each row, as in a verify step)."""

    def __init__(self, batch: int, longest: int, width: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.lengths = lengths_for(batch, longest)
        self.width, self.heads, self.kv_heads, self.scale = width, heads, kv_heads, head_dim ** -0.5
        self.q = torch.randn(batch, heads, width, head_dim, device=device, dtype=dtype)
        self.k = torch.randn(batch, kv_heads, longest, head_dim, device=device, dtype=dtype)
        self.v = torch.randn(batch, kv_heads, longest, head_dim, device=device, dtype=dtype)
        lengths = torch.tensor(self.lengths, device=device)
        positions = lengths[:, None] - width + torch.arange(width, device=device)[None, :]  # [batch, width]
        self.mask = (torch.arange(longest, device=device)[None, None, :] <= positions[:, :, None])[:, None]
        self.positions = positions

    def dense(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask, scale=self.scale,
                                              enable_gqa=self.heads != self.kv_heads)

    def per_row(self) -> torch.Tensor:
        out = []
        for row, n in enumerate(self.lengths):
            # The row's own columns; its new tokens are its last `width`, causal among themselves.
            causal = torch.ones(self.width, n, dtype=torch.bool, device=self.q.device).tril(n - self.width)
            out.append(F.scaled_dot_product_attention(self.q[row : row + 1], self.k[row : row + 1, :, :n],
                                                      self.v[row : row + 1, :, :n], attn_mask=causal,
                                                      scale=self.scale, enable_gqa=self.heads != self.kv_heads))
        return torch.cat(out)

    def flex(self):
        """A compiled FlexAttention call with the rows' block mask, or None where it cannot run."""
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            return None
        positions = self.positions

        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= positions[b, q_idx]

        batch, longest = len(self.lengths), self.k.shape[2]
        block_mask = create_block_mask(visible, batch, None, self.width, longest, device=str(self.q.device))
        compiled = torch.compile(flex_attention, dynamic=False)
        gqa = self.heads != self.kv_heads
        return lambda: compiled(self.q, self.k, self.v, block_mask=block_mask, scale=self.scale, enable_gqa=gqa)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles: minutes on a CPU)")
    parser.add_argument("--out", default="bench-out/attention.json")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kind = "cuda" if device.type == "cuda" else "cpu"
    shape, grid = SHAPES[kind], GRIDS[kind]
    rows = []
    for batch in grid["batch"]:
        for longest in grid["longest"]:
            for width in grid["width"]:
                case = Case(batch, longest, width, device=device, dtype=dtype, **shape)
                reference = case.per_row()
                row = {"batch": batch, "longest": longest, "width": width, "mean_length": sum(case.lengths) / batch}
                methods = {"dense": case.dense, "per row": case.per_row}
                flex = None
                if not args.no_flex:
                    try:
                        flex = case.flex()
                        if flex is not None:
                            flex()  # compile outside the timing
                    except Exception as error:  # noqa: BLE001 - reported, the other two still run
                        print(f"flex attention unavailable on {device}: {type(error).__name__}: {error}", flush=True)
                        args.no_flex = True
                        flex = None
                if flex is not None:
                    methods["flex"] = flex
                for name, fn in methods.items():
                    error = (fn().float() - reference.float()).abs().max().item()
                    if error > 0.05:
                        raise SystemExit(f"{name} differs from the per-row reference by {error} at {row}")
                    row[name] = median_ms(fn, device, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    names = [name for name in ("dense", "per row", "flex") if name in rows[0]]
    print(f"\n## attention, one layer, ms ({device}, {args.dtype}, {shape['heads']} heads over {shape['kv_heads']}, "
          f"head dim {shape['head_dim']}; rows from longest/8 to longest; median of {args.repeats})\n")
    print("| batch | longest | new tokens | " + " | ".join(names) + " | dense / best |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for row in rows:
        best = min(row[name] for name in names)
        print(f"| {row['batch']} | {row['longest']} | {row['width']} | " + " | ".join(f"{row[n]:.3f}" for n in names)
              + f" | {row['dense'] / best:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": str(device), "dtype": args.dtype, "shape": shape, "rows": rows},
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

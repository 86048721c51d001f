"""The engine's own forward, eager against torch.compile (inductor, freezing) at static shapes (issue 15).

The issue asks to compare the eager forward (weights prepacked once for oneDNN, ``specbatch.models.llama``)
with ``torch.compile`` and keep the faster. Compiling with dynamic shapes never finished on a
2-core machine, so this compiles one static shape at a time, as the captured steps' buckets would
(``specbatch.engine.captured``): batch × new tokens at context 128, attended columns padded to 192.

Freezing folds and prepacks only weights that are parameters of the compiled module, so the
compiled forward is the same code over plain weights (``onednn_prepacks`` off), the fused ones
registered as parameters of a holder module; inductor then packs them itself (MKL's packed sgemm
in float32, oneDNN in bf16). Prints, per shape: eager ms, compiled ms, their ratio, the compile
time and the largest logit difference. Runs the dtype ``--dtype auto`` picks on this CPU.

    .venv/bin/python benchmarks/compile_static.py [--threads 1] [--repeats 20] [--shapes 1x1,1x5,8x1,8x4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from specbatch.engine.kv_pool import write_columns_and_mask
from specbatch.kernels.linear import PackedLinear
from specbatch.models.llama import LlamaForward
from specbatch.models.loading import ModelSpec, load_model, parse_dtype

CONTEXT = 128
ATTENDED = 192  # the context bucket a call at CONTEXT + a few tokens pads to
POOL_COLUMNS = 257  # 256 columns and the scratch column


class CompiledForward(torch.nn.Module):
    """``LlamaForward`` over plain weights, every linear layer's weight a parameter of this module
    so that inductor's freezing sees it (a tensor reached through a plain object is a graph input,
    which freezing leaves alone)."""

    def __init__(self, model):
        super().__init__()
        with mock.patch("specbatch.kernels.linear.onednn_prepacks", lambda weight: False):
            self.forward_of = LlamaForward(model)
        for owner in [self.forward_of, *self.forward_of.layers]:
            for name, value in vars(owner).items():
                if isinstance(value, PackedLinear):
                    value.weight = torch.nn.Parameter(value.weight, requires_grad=False)
                    self.register_parameter(f"{type(owner).__name__}{id(owner)}_{name}", value.weight)

    def forward(self, *args):
        # __wrapped__: past LlamaForward's inference_mode, which dynamo cannot trace over
        # tensors made outside it; the caller runs it under no_grad.
        return LlamaForward.__call__.__wrapped__(self.forward_of, *args)


def inputs(config, dtype, batch: int, width: int):
    """A call of ``width`` new tokens per row at position CONTEXT, over a pool view from slot 0."""
    kv = torch.zeros(config.num_hidden_layers, 2, batch, config.num_key_value_heads, POOL_COLUMNS,
                     config.hidden_size // config.num_attention_heads, dtype=dtype)
    ids = torch.randint(100, 1000, (batch, width), generator=torch.Generator().manual_seed(batch * 100 + width))
    positions = torch.arange(CONTEXT, CONTEXT + width).repeat(batch, 1)
    columns, mask = write_columns_and_mask(positions, torch.ones(batch, width, dtype=torch.bool), POOL_COLUMNS - 1,
                                           ATTENDED)
    return ids, positions, columns, kv, mask, width


def median_ms(forward, args, repeats: int) -> float:
    for _ in range(3):
        forward(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a service's on 2 cores: 1)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default="1x1,1x5,8x1,8x4", help="batch x new tokens, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    dynamo_config.recompile_limit = 64  # one compile per static shape

    dtype = parse_dtype("auto", "cpu")
    model = load_model(ModelSpec(), "cpu", dtype)
    eager = LlamaForward(model)
    compiled_module = torch.compile(CompiledForward(model), dynamic=False)

    def compiled(*call):
        with torch.no_grad():
            return compiled_module(*call)

    print(f"SmolLM2-135M, {dtype}, context {CONTEXT} (attended columns padded to {ATTENDED}), {args.threads} thread(s)")
    print("\n| batch × new tokens | eager ms | compiled ms | eager / compiled | compile s | max logit difference |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, width = (int(n) for n in shape.split("x"))
        call = inputs(model.config, dtype, batch, width)
        eager_ms = median_ms(eager, call, args.repeats)
        start = time.perf_counter()
        compiled(*call)
        compile_s = time.perf_counter() - start
        compiled_ms = median_ms(compiled, call, args.repeats)
        difference = (eager(*call)[0] - compiled(*call)[0]).abs().max().item()
        print(f"| {batch} × {width} | {eager_ms:.1f} | {compiled_ms:.1f} | {eager_ms / compiled_ms:.2f} | "
              f"{compile_s:.0f} | {difference:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

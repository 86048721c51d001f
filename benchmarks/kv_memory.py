"""How many sequences a GPU holds at real sizes: the engine's KV pool, which keeps a slot per
sequence at the longest context, against a paged layout, which keeps what each sequence has
written, in pages of ``--page`` tokens.

For a target shape (and a draft shape on the same GPU, or none), in ``--dtype``, on a GPU of
``--gib`` GiB (default: this machine's GPU, else 80): the weights, the keys and values a token
costs, and the sequences that fit at each ``--contexts`` length, as the pool lays them out (one
slot of context + 1 columns, the scratch column included, as ``KVPool.fix`` allocates with CUDA
graphs) and as a paged layout would (sequences of ``--mean-tokens`` tokens written, rounded up
to whole pages; at full length both hold the same). What is left beside weights and caches for
activations and captured graphs is ``--reserve-gib``; on a GPU, ``--measure`` builds the target
with random weights and reads it instead: the memory a verify of ``--measure-batch`` sequences at
k = 4 takes beyond the weights.

Shapes are counted on PyTorch's meta device: nothing is allocated without ``--measure``, so the
report runs anywhere. It prints a table and writes benchmarks/results/<machine>/kv-memory.json.

    .venv/bin/python benchmarks/kv_memory.py --target llama-3-8b --draft llama-3.2-1b
"""

from __future__ import annotations

import argparse
import math

import torch

from specbatch.commands import results
from specbatch.models.random_weights import random_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GIB = 2**30
# The sequences a GPU pool must hold at 2k tokens before it is worth paging (the batch sizes the
# paper's curve spans).
PAGE_BELOW = 64


def shape_of(name: str, dtype: torch.dtype) -> dict:
    """A shape's weight bytes (parameters counted once, tied ones too) and KV bytes per token."""
    from transformers import AutoModelForCausalLM

    config = random_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    params = sum(p.numel() for p in model.parameters())  # (parameters() lists a tied one once)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"shape": name, "parameters": params, "weights_bytes": params * size,
            "kv_bytes_per_token": config.num_hidden_layers * 2 * kv_heads * head_dim * size}


def sequences(free_bytes: float, per_token: int, tokens: int) -> int:
    return max(0, int(free_bytes // (per_token * tokens)))


def measured_reserve(name: str, dtype: torch.dtype, batch: int, context: int) -> float:
    """On the GPU: bytes a verify of ``batch`` sequences (k = 4, ``context`` tokens each cached)
    takes beyond the weights and the pool: the activations' peak."""
    from specbatch.engine.batch import SequenceInput
    from specbatch.engine.engine import Engine
    from specbatch.models.random_weights import random_model
    from target_service.verifier import VerifyItem, verify

    engine = Engine(random_model(name, "cuda", dtype), max_sequences=batch, max_context=context + 8,
                    captured_steps="off")
    vocab = engine.vocab_size
    for first in range(0, batch, 8):  # (a few prompts at a time: a prefill's own peak is not the question)
        engine.run(engine.prefill, [SequenceInput(f"s{i}", 0, [(i + j) % vocab for j in range(context)])
                                    for i in range(first, min(first + 8, batch))])

    def step() -> float:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        verify(engine, [VerifyItem(SequenceInput(f"s{i}", context, [1]), [2, 3, 4, 5]) for i in range(batch)])
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)

    return engine.run(step)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="llama-3-8b")
    parser.add_argument("--draft", default="llama-3.2-1b", help="a shape on the same GPU, or 'none'")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--gib", type=float, help="the GPU's memory (default: this GPU's, else 80)")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--mean-tokens", type=int, default=1024, help="tokens a sequence has written, on average")
    parser.add_argument("--page", type=int, default=16, help="tokens per page of the paged layout")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="kept for activations and captured graphs (see --measure)")
    parser.add_argument("--measure", action="store_true", help="on a GPU: measure the reserve instead")
    parser.add_argument("--measure-batch", type=int, default=64)
    results.add_output_flags(parser, "kv-memory")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    gpu = torch.cuda.is_available()
    total = args.gib * GIB if args.gib else (torch.cuda.get_device_properties(0).total_memory if gpu else 80 * GIB)
    shapes = [shape_of(args.target, dtype)] + ([] if args.draft == "none" else [shape_of(args.draft, dtype)])
    weights = sum(s["weights_bytes"] for s in shapes)
    per_token = sum(s["kv_bytes_per_token"] for s in shapes)  # every sequence is cached by both models
    reserve = args.reserve_gib * GIB
    if args.measure:
        if not gpu:
            parser.error("--measure needs a GPU")
        shortest = min(int(c) for c in args.contexts.split(","))
        reserve = measured_reserve(args.target, dtype, args.measure_batch, shortest)
    free = total - weights - reserve
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        written = min(args.mean_tokens, context)
        pool = sequences(free, per_token, context + 1)
        paged = sequences(free, per_token, math.ceil(written / args.page) * args.page)
        rows.append({"context": context, "pool_sequences": pool, "paged_sequences": paged,
                     "paged_at_full_length": sequences(free, per_token, math.ceil(context / args.page) * args.page),
                     "pool_gib_per_sequence": per_token * (context + 1) / GIB,
                     # what to give each service's --kv-cache-gb for that many (the default is 8)
                     "kv_cache_gb": " / ".join(f"{pool * s['kv_bytes_per_token'] * (context + 1) / GIB:.1f}"
                                               for s in shapes),
                     "page_it": context <= 2048 and pool < PAGE_BELOW})
    report = {"target": shapes[0], "draft": shapes[1] if len(shapes) > 1 else None, "dtype": args.dtype,
              "gpu_gib": total / GIB, "weights_gib": weights / GIB, "reserve_gib": reserve / GIB,
              "reserve_measured": args.measure, "mean_tokens": args.mean_tokens, "page": args.page, "rows": rows}
    pair = args.target + ("" if args.draft == "none" else f" + {args.draft}")
    print(f"{pair} in {args.dtype} on {total / GIB:.0f} GiB: "
          f"weights {weights / GIB:.1f} GiB, reserve {reserve / GIB:.1f} GiB"
          f"{' (measured)' if args.measure else ''}, keys and values {per_token / 2**10:.0f} KiB a token")
    print(results.table(rows))
    results.write("kv-memory", report, args.out, args.variant)
    return report


if __name__ == "__main__":
    main()

"""Keys and values in bfloat16 against float32: the target's verify step at large batches and long
contexts, where attention reads the cache from memory (docs/engine.md, "Keys and values in bfloat16").

Times ``target_service.verifier.verify`` on the embedded SmolLM2-135M in the form the embedded
target service runs here (its linear layers on the engine's bf16 or float16 dot products, the layers
in one C call, one thread and ``--wide-threads`` threads for calls of 12 rows and more), once with
a float32 KV pool and once with ``kv_bf16``; the two engines take turns at every cell, so the
machine's drift lands on both alike. Prints each cell's milliseconds and the ratio float32 / bf16.

With ``--quality N``, first how far the rounding moves the model: N held-out ShareGPT prompts
decoded greedily (target-only, ``--tokens`` each) with either pool, the outputs that differ, where,
and the float32 pool's top-2 logit gap there (``specbatch.engine.exactness.NEAR_TIE`` is the bound the
exactness runs hold mismatches to).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_cache.py [--contexts 128,300,600] [--batches 1,8,32] [--quality 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from specbatch.commands.bench.engine import Bench, Grid
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.engine.engine import Engine
from specbatch.engine.exactness import NEAR_TIE, first_mismatch, target_only
from specbatch.kernels import build
from specbatch.models.loading import ModelSpec, chat_token_ids, load_model, load_tokenizer


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def compare_outputs(engines: dict[str, Engine], args) -> dict:
    """Greedy target-only decoding of the same prompts with the float32 and the bf16 pool."""
    tokenizer = load_tokenizer(ModelSpec())
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": text}])
               for text in sharegpt_prompts(args.quality, args.prompt_start)]
    differ = []
    for i, prompt in enumerate(prompts):
        reference = target_only(engines["float32"], prompt, args.tokens)
        mismatch = first_mismatch(target_only(engines["bf16"], prompt, args.tokens).tokens, reference)
        if mismatch is not None:
            differ.append({"prompt": i, "position": mismatch.position, "gap": round(mismatch.gap, 4)})
    gaps = ", ".join(f"{d['gap']:.3f} (token {d['position']})" for d in differ) or "-"
    print(f"greedy, {len(prompts)} prompts x {args.tokens} tokens: {len(differ)} outputs differ between the pools; "
          f"the float32 pool's top-2 gap where they do: {gaps}; {sum(d['gap'] >= NEAR_TIE for d in differ)} "
          f"at a gap of {NEAR_TIE} or more", flush=True)
    return {"prompts": len(prompts), "tokens": args.tokens, "differ": differ}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=ints, default=(128, 300, 600))
    parser.add_argument("--batches", type=ints, default=(1, 8, 32))
    parser.add_argument("--new", type=ints, default=(1, 2), help="tokens fed per sequence (1: target-only decoding)")
    parser.add_argument("--wide-threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=5, help="turns of the two engines per cell (2 calls each)")
    parser.add_argument("--quality", type=int, default=0, metavar="N", help="prompts decoded with either pool first")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt for --quality")
    parser.add_argument("--prompt-start", type=int, default=16000, help="ShareGPT conversation to start from (held out)")
    parser.add_argument("--out", default="bench-out/kv_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not build.available():
        raise SystemExit(f"the engine's CPU kernels are unavailable: {build.unavailable_reason()}")
    form = ({"fp16_dot": True} if build.fp16_dot_available() else {"bf16_dot": True}
            if build.bf16_dot_available() else {"bf16_weights": True})
    model = load_model(ModelSpec(), "cpu", torch.float32)
    engines = {kv: Engine(model, kv_bf16=kv == "bf16", wide_threads=args.wide_threads, wide_from_rows=12,
                          max_sequences=max(args.batches), **form)
               for kv in ("float32", "bf16")}
    print(f"SmolLM2-135M, linear layers {next(iter(form))}, 1 thread ({args.wide_threads} from 12 rows a call), "
          f"median of {args.turns} turns of 2 calls a cell", flush=True)
    quality = compare_outputs(engines, args) if args.quality else None
    rows = []
    for context in args.contexts:
        grid = Grid(batch_sizes=(max(args.batches),), context=context, repeats=2, warmup=1)
        benches = {kv: Bench(engine, grid) for kv, engine in engines.items()}
        for batch in args.batches:
            for new in args.new:
                turns = {kv: [] for kv in benches}
                for _ in range(args.turns):
                    for kv, bench in benches.items():
                        turns[kv].append(bench.verify_ms(batch, new))
                ms = {kv: statistics.median(times) for kv, times in turns.items()}
                rows.append({"context": context, "batch": batch, "new": new, "float32_ms": ms["float32"],
                             "bf16_ms": ms["bf16"], "ratio": ms["float32"] / ms["bf16"]})
                print(f"context {context}, {batch} x {new}: float32 KV {ms['float32']:.1f} ms, bf16 KV "
                      f"{ms['bf16']:.1f} ms, float32/bf16 {ms['float32'] / ms['bf16']:.2f}", flush=True)
        for bench in benches.values():
            bench.close()
    print("\n| context | batch × new tokens | float32 KV, ms | bf16 KV, ms | float32 / bf16 |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['context']} | {row['batch']} × {row['new']} | {row['float32_ms']:.1f} | {row['bf16_ms']:.1f} "
              f"| {row['ratio']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"quality": quality, "verify": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Keys and values in bfloat16 against float32: the target's verify step at large batches and long
contexts, where attention reads the cache from memory (docs/decisions/kv-bf16.md).

Times ``target_service.verifier.verify`` on the embedded SmolLM2-135M in the form and with the
threads the embedded target service runs here under specbatch up (``--weights auto``: its linear
layers on the engine's float16 or bf16 dot products or bf16 weights; ``--threads``, else half the
cores, its calls wide onto every core), once with a float32 KV pool and once with ``kv_bf16``; the
two engines take turns at every cell, so the machine's drift lands on both alike. Prints each
cell's milliseconds and the ratio float32 / bf16, and writes them to
benchmarks/results/<machine>/kv-cache.json (or ``--out``).

With ``--quality N``, first how far the rounding moves the model: N held-out ShareGPT prompts
decoded greedily (target-only, ``--tokens`` each) with either pool, the outputs that differ, where,
and the float32 pool's top-2 logit gap there (``specbatch.engine.exactness.NEAR_TIE`` is the bound the
exactness runs hold mismatches to).

    .venv/bin/python benchmarks/kv_cache.py [--contexts 128,300,600] [--batches 1,8,32] [--quality 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specbatch.commands import results
from specbatch.commands.bench.engine import Bench, Grid
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.engine.engine import Engine
from specbatch.engine.exactness import NEAR_TIE, first_mismatch, target_only
from specbatch.kernels import build, forms
from specbatch.models.loading import ModelSpec, chat_token_ids, load_model, load_tokenizer
from specbatch.stack.defaults import StackOptions, available_cores, threads_per_service


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
    parser.add_argument("--threads", type=int, help="as specbatch up's --threads (default: half the cores)")
    parser.add_argument("--turns", type=int, default=5, help="turns of the two engines per cell (2 calls each)")
    parser.add_argument("--quality", type=int, default=0, metavar="N", help="prompts decoded with either pool first")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt for --quality")
    parser.add_argument("--prompt-start", type=int, default=16000, help="ShareGPT conversation to start from (held out)")
    results.add_output_flags(parser, "kv-cache")
    args = parser.parse_args()
    form = forms.machine_target_form()
    if form == "model":
        raise SystemExit(f"the engine's CPU kernels are unavailable: {build.unavailable_reason()}")
    # Threads as specbatch up gives the target service: half the cores, each call wide onto all of them.
    threads, cores = threads_per_service(StackOptions(threads=args.threads)), available_cores()
    torch.set_num_threads(threads)
    model = load_model(ModelSpec(), "cpu", torch.float32)
    engines = {kv: Engine(model, weights=form, kv_bf16=kv == "bf16", wide_threads=cores if cores > threads else 0,
                          wide_from_rows=1, max_sequences=max(args.batches))
               for kv in ("float32", "bf16")}
    print(f"SmolLM2-135M, linear layers {form}, {threads} threads (calls on {max(cores, threads)}), "
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
    results.write("kv-cache", {"weights": form, "threads": threads, "turns": args.turns, "quality": quality,
                               "verify": rows}, out=args.out, variant=args.variant, device="cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Greedy exactness of the embedded models through the three services, in bf16 or fp32 (issue 15).

Decodes held-out ShareGPT prompts target-only (k=0, one token per call, through the target
service's own engine) and speculatively through the services, at batch 1 and in mixed batches
(k 1-5 per request, up to 16 sequences a step), with leaves beside the first draft as well
(``--runs leaves``: 3 at batch 1, 0-3 a request in mixed batches), and counts every output that leaves the
reference, with the reference's top-2 logit gap where it does: each must be a near-tie
(``specbatch.engine.exactness.NEAR_TIE``); in fp32 there should be none. Also measures how often the
engine's linear layers, in the same dtype, round differently with more rows.

    .venv/bin/python benchmarks/exactness.py [--prompts 64] [--tokens 64] [--runs chain,leaves] [--out bench-out/exactness.json]
    # the embedded services' default where the CPU has AVX512_BF16: float32, linear layers on bf16
    # dot products (the target's and the draft's), or with --draft-int8 the draft in int8 as served
    .venv/bin/python benchmarks/exactness.py --dtype float32 --weights bf16-dot [--draft-int8]
    # as specbatch up serves on 2 cores: one thread a call, every core for calls of 12 rows and more
    .venv/bin/python benchmarks/exactness.py --dtype float32 --weights bf16-dot --draft-int8 --threads 1 --wide-threads 2
    # with both services' keys and values in bf16 (--kv-bf16)
    .venv/bin/python benchmarks/exactness.py --dtype float32 --weights bf16-dot --draft-int8 --threads 1 --wide-threads 2 --kv-bf16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specbatch.commands.prompts import sharegpt_prompts
from specbatch.engine.exactness import NEAR_TIE, first_mismatch, row_dependence, target_only
from specbatch.kernels.linear import linear
from specbatch.models.embedded import EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, chat_token_ids, load_model, load_tokenizer
from specbatch.rpc.client import generate, generate_all, make_request
from specbatch.stack.in_process import start_local_stack


def judge(name: str, outputs: list[list[int]], references) -> dict:
    mismatches = [(i, m) for i, (out, ref) in enumerate(zip(outputs, references))
                  if (m := first_mismatch(out, ref)) is not None]
    compared = sum(min(len(o), len(r.tokens)) for o, r in zip(outputs, references))
    row = {"run": name, "sequences": len(outputs), "tokens_compared": compared, "mismatched_sequences": len(mismatches),
           "mismatches": [{"prompt": i, "position": m.position, "gap": round(m.gap, 4), "near_tie": m.near_tie}
                          for i, m in mismatches]}
    row["all_near_ties"] = all(m.near_tie for _, m in mismatches)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-start", type=int, default=16000, help="ShareGPT conversation to start from (held out)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", default="chain,leaves", help="chain (k = 1, 3, 5 and mixed), leaves (with leaves)")
    parser.add_argument("--weights", choices=("bf16", "bf16-dot", "fp16-dot", "q4_1"), default=None,
                        help="both engines' linear layers (float32 only): bf16 weights, bf16 dot products, float16 "
                             "products, or the decoder layers in the GGUF's Q4_1 blocks (head on bf16 dot products)")
    parser.add_argument("--draft-int8", action="store_true", help="the draft's linear layers in int8, as served")
    parser.add_argument("--kv-bf16", action="store_true", help="both engines keep their keys and values in bf16")
    parser.add_argument("--wide-threads", type=int, default=0,
                        help="both engines' calls of 12 rows and more on this many threads, the rest on --threads "
                             "(as specbatch up serves: --threads 1 --wide-threads 2); 0: every call on --threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the engines there (captured steps as served)")
    parser.add_argument("--out", default="bench-out/exactness.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(ModelSpec(), args.device, args.dtype)
    draft = load_model(ModelSpec(EMBEDDED_DRAFT), args.device, args.dtype)
    tokenizer = load_tokenizer(ModelSpec())
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": text}])
               for text in sharegpt_prompts(args.prompts, args.prompt_start)]
    form = {"weights": args.weights} if args.weights else {}
    both = {"wide_threads": args.wide_threads} if args.wide_threads else {}  # both engines' options
    both.update({"kv_bf16": True} if args.kv_bf16 else {})
    stack = start_local_stack(target, draft, tokenizer, max_batch_size=16, max_new_tokens=args.tokens,
                              target_engine_options={**form, **both},
                              draft_engine_options={"weights": "int8", **both} if args.draft_int8 else {**form, **both})
    try:
        start = time.perf_counter()
        references = [target_only(stack.target_engine, p, args.tokens) for p in prompts]
        print(f"references: {len(prompts)} prompts x {args.tokens} tokens in {time.perf_counter() - start:.0f} s",
              flush=True)
        client = stack.client()
        rows = []
        runs = args.runs.split(",")
        batch1 = [(k, 0) for k in (1, 3, 5)] * ("chain" in runs) + [(2, 3)] * ("leaves" in runs)
        for k, leaves in batch1:
            outputs = [generate(client, make_request(p, args.tokens, k=k, leaves=leaves, ignore_eos=True),
                                timeout=600).token_ids for p in prompts]
            rows.append(judge(f"batch 1, k={k}" + (f", {leaves} leaves" if leaves else ""), outputs, references))
            print(rows[-1]["run"], rows[-1]["mismatched_sequences"], flush=True)
        for name, leaves in (("", lambda i: 0),) * ("chain" in runs) + ((", leaves 0..3", lambda i: i % 4),) * (
                "leaves" in runs):
            mixed = generate_all(client, [make_request(p, args.tokens, k=1 + i % 5, leaves=leaves(i), ignore_eos=True)
                                          for i, p in enumerate(prompts)], timeout=1200)
            rows.append(judge(f"mixed batches of up to 16, k=1..5{name}", [r.token_ids for r in mixed], references))
        gaps = [g for r in references for g in r.gaps]
    finally:
        stack.stop()
    dependence = row_dependence([(960, 576), (3072, 576), (576, 1536), (576, 576), (49152, 576)],
                                [1, 2, 4, 6, 8, 16, 32, 64], dtype=target.dtype,
                                layer=lambda weight: linear(weight, weights=args.weights))
    dtype = (str(target.dtype).removeprefix("torch.") + (f" ({args.weights} linear layers)" if args.weights else "")
             + (" (bf16 keys and values)" if args.kv_bf16 else ""))

    print(f"\n## {dtype} greedy exactness ({len(prompts)} held-out ShareGPT prompts, {args.tokens} tokens each; "
          f"near-tie bound {NEAR_TIE} logits)\n")
    print("| run | sequences | tokens compared | sequences that differ | gaps where they differ | all near-ties |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        gaps_at = ", ".join(f"{m['gap']:.3f}" for m in row["mismatches"]) or "-"
        print(f"| {row['run']} | {row['sequences']} | {row['tokens_compared']} | {row['mismatched_sequences']} | "
              f"{gaps_at} | {'yes' if row['all_near_ties'] else 'NO'} |")
    small, ties = sum(g < NEAR_TIE for g in gaps), sum(g == 0 for g in gaps)
    print(f"\nReference positions with a top-2 gap below {NEAR_TIE}: {small} of {len(gaps)} ({small / len(gaps):.2%}); "
          f"exact ties in the {dtype} logits: {ties} ({ties / len(gaps):.2%}).")
    print(f"\n## Outputs of the {dtype} linear layer that differ from the same rows computed one at a time\n")
    ms = list(next(iter(dependence.values())))
    print("| weight | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for shape, by_m in dependence.items():
        print(f"| {shape} | " + " | ".join(f"{by_m[m]:.1e}" if by_m[m] else "0" for m in ms) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"near_tie": NEAR_TIE, "runs": rows, "row_dependence": dependence,
                                          "reference_gaps_below_bound": small, "reference_exact_ties": ties,
                                          "reference_positions": len(gaps)},
                                         indent=1))
    return 0 if all(row["all_near_ties"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

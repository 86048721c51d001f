"""Greedy exactness of the embedded models through the three services, in the form specbatch up
serves them here (or another: ``--weights``, ``--dtype``).

Decodes held-out ShareGPT prompts target-only (k=0, one token per call, through the target
service's own engine) and speculatively through the services, at batch 1 and in mixed batches
(k 1-5 per request, up to 16 sequences a step), with leaves beside the first draft as well
(``--runs leaves``: 3 at batch 1, 0-3 a request in mixed batches), and counts every output that leaves the
reference, with the reference's top-2 logit gap where it does: each must be a near-tie
(``specbatch.engine.exactness.NEAR_TIE``); in float32 there should be none. Also measures how often the
engine's linear layers, in the same form, round differently with more rows. Writes the result to
benchmarks/results/<machine>/exactness.json (or ``--out``).

    .venv/bin/python benchmarks/exactness.py [--prompts 64] [--tokens 64] [--runs chain,leaves]
    # the weight forms as specbatch up decides them (--weights auto), or one named, e.g.
    .venv/bin/python benchmarks/exactness.py --weights q4_1
    # the models as loaded, in bf16 (on a GPU: --device cuda)
    .venv/bin/python benchmarks/exactness.py --weights model --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from specbatch.commands import results
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.config.options import WEIGHT_FORMS
from specbatch.engine.exactness import NEAR_TIE, first_mismatch, row_dependence, target_only
from specbatch.kernels import forms
from specbatch.kernels.linear import linear
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, chat_token_ids, load_model, load_tokenizer
from specbatch.rpc.client import generate, generate_all, make_request
from specbatch.service.main import engine_settings
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
    parser.add_argument("--dtype", default="auto", help="as specbatch up's --dtype")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_FORMS,
                        help="as specbatch up's --weights: the target's form, the draft's decided beside it")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of the engines")
    parser.add_argument("--runs", default="chain,leaves", help="chain (k = 1, 3, 5 and mixed), leaves (with leaves)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the engines there (captured steps as served)")
    results.add_output_flags(parser, "exactness")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    # Each engine as its service builds it under specbatch up: the pair of forms the launcher
    # decides, keys and values in bf16 beside a 16-bit form.
    pair = forms.decide(args.weights, True, args.device, args.dtype)
    models, options = {}, {}
    for kind, name in (("target", EMBEDDED), ("draft", EMBEDDED_DRAFT)):
        settings = engine_settings(kind, SimpleNamespace(model=name, num_layers=None, trust_remote_code=False,
                                                         random_weights=False, device=args.device, dtype=args.dtype,
                                                         weights=getattr(pair, kind), threads=args.threads))
        models[kind] = load_model(settings["spec"], args.device, settings["dtype"])
        options[kind] = {"weights": settings["weights"], "kv_bf16": settings["kv_bf16"]}
    target = models["target"]
    tokenizer = load_tokenizer(ModelSpec())
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": text}])
               for text in sharegpt_prompts(args.prompts, args.prompt_start)]
    stack = start_local_stack(target, models["draft"], tokenizer, max_batch_size=16, max_new_tokens=args.tokens,
                              target_engine_options=options["target"], draft_engine_options=options["draft"])
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
                                layer=lambda weight: linear(weight, weights=options["target"]["weights"]))
    dtype = (str(target.dtype).removeprefix("torch.") + f" (target {pair.target}, draft {pair.draft} linear layers"
             + (", bf16 keys and values)" if options["target"]["kv_bf16"] else ")"))

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
    results.write("exactness", {"dtype": dtype, "weights": {"target": pair.target, "draft": pair.draft},
                                "prompts": len(prompts), "tokens": args.tokens, "near_tie": NEAR_TIE, "runs": rows,
                                "row_dependence": dependence, "reference_gaps_below_bound": small,
                                "reference_exact_ties": ties, "reference_positions": len(gaps)},
                  out=args.out, variant=args.variant, device=args.device)
    return 0 if all(row["all_near_ties"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

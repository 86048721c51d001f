"""Batch 1, greedy, held-out ShareGPT prompts: speculative serving against its two baselines.

In one run, on the same prompts and token counts:
1. plain transformers ``generate()`` of the embedded target in float32, in this process (the
   services are not running yet, so it has the machine to itself);
2. the three services as processes (``specbatch up``'s launcher, threads pinned per service),
   each prompt sent target-only (``k = 0``) and then under the coordinator's k policy (once per
   ``--leaves`` count: the draft's next-best tokens verified beside its first; once per
   ``--prompt-lookup`` length, default 6: drafts copied from the request's history where found, as
   the embedded default does), prompt by prompt (so the modes share any drift in the machine's speed).
   Modes other than the lookup ones ask the draft at every step.
   With ``--shared-lookup TOKENS`` each lookup mode has a twin that also drafts from finished
   requests' texts (the coordinator's shared index). Before the timed prompts, ``--shared-warmup``
   other ShareGPT prompts (from ``--shared-warmup-start``, none equal to a timed one) are served
   target-only into the index, as a server would have served other users; during the run only the
   shared twins read or add to it, so no mode drafts from an answer to the prompt it is serving.
Prints tokens/s of each and the ratios, where each mode's decode step spends its time (the
coordinator's step totals: RPC time beside the compute the services report), and writes them as a
result (benchmarks/results/<machine>/batch1.json, or ``--out``).

    .venv/bin/python benchmarks/batch1.py [--prompts 24] [--tokens 96] [--k-policy profile --profile P] [--leaves 0,1,2]
        [--prompt-lookup 4,6:policy] [--shared-lookup 200000 --shared-warmup 256] [--weights q4_1]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from specbatch.commands import results
from specbatch.commands.prompts import chat_prompts, sharegpt_prompts
from specbatch.models.loading import ModelSpec, load_model, load_tokenizer
from specbatch.rpc.client import connect, generate, generate_all, make_request
from specbatch.stack.defaults import StackOptions
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as pb


def transformers_generate(prompts: list[list[int]], tokens: int, threads: int) -> float:
    """tokens/s of ``model.generate`` (greedy, fp32, its own KV cache), one prompt at a time."""
    torch.set_num_threads(threads)
    model = load_model(ModelSpec(), "cpu", torch.float32)
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
    generated, seconds = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        seconds += time.perf_counter() - start
        generated += out.shape[1] - len(prompt)
    del model
    return generated / seconds


STEP_PARTS = ("step_seconds", "draft_seconds", "draft_compute_seconds", "target_seconds", "target_compute_seconds")
LEAF_COUNTS = ("leaf_chances", "leaf_hits", "lookup_chains", "lookup_drafted",
               "lookup_accepted", "shared_lookup_chains", "shared_lookup_accepted")


def step_totals(stub) -> dict:
    totals = stub.Info(pb.InfoRequest()).totals
    return {"steps": totals.steps, **{part: getattr(totals, part) for part in STEP_PARTS + LEAF_COUNTS}}


def where_step_time_goes(totals: dict, seconds: float) -> dict:
    """ms per decode step of each part (``totals``: the growth of the coordinator's StepTotals over
    requests that took ``seconds``): the draft's and target's RPC wall time and the compute the
    services report inside it, the rest of the step in the coordinator, and the time between steps
    (request ends, streaming, admission)."""
    steps = totals["steps"]
    ms = {part: 1e3 * totals[part] / steps for part in STEP_PARTS}
    return {"draft compute": ms["draft_compute_seconds"],
            "draft RPC beyond compute": ms["draft_seconds"] - ms["draft_compute_seconds"],
            "target compute": ms["target_compute_seconds"],
            "target RPC beyond compute": ms["target_seconds"] - ms["target_compute_seconds"],
            "coordinator, in step": ms["step_seconds"] - ms["draft_seconds"] - ms["target_seconds"],
            "outside steps": 1e3 * seconds / steps - ms["step_seconds"]}


def served(address: str, prompts: list[list[int]], tokens: int,
           modes: dict[str, dict]) -> dict[str, dict]:
    """Each prompt through the coordinator once per mode (``modes``: name -> the request's fields:
    k (None for the coordinator's policy), leaves), the modes taking turns prompt by
    prompt: a machine whose speed drifts during the run (shared hosts do, by 10 % and more) then
    slows every mode alike."""
    stub = connect(address)
    for fields in modes.values():  # warm-up (kept out of any shared index: prompts[0] is timed below)
        generate(stub, make_request(prompts[0], 4, ignore_eos=True, **{**fields, "shared_lookup": False}))
    sums = {name: collections.Counter() for name in modes}
    for prompt in prompts:
        for name, fields in modes.items():
            before = step_totals(stub)
            result = generate(stub, make_request(prompt, tokens, ignore_eos=True, **fields), timeout=600)
            after = step_totals(stub)
            sums[name].update({part: after[part] - before[part] for part in after})
            sums[name].update(generated=len(result.token_ids), seconds=result.seconds, request_steps=result.stats.steps,
                              proposed=result.stats.draft_tokens_proposed,
                              accepted=result.stats.draft_tokens_accepted)
    return {name: {"tokens_per_second": s["generated"] / s["seconds"],
                   "acceptance": s["accepted"] / s["proposed"] if s["proposed"] else 0.0,
                   "tokens_per_step": s["generated"] / s["request_steps"] if s["request_steps"] else 0.0,
                   "leaf_hit_rate": s["leaf_hits"] / s["leaf_chances"] if s["leaf_chances"] else 0.0,
                   "lookup_share": s["lookup_chains"] / s["request_steps"] if s["request_steps"] else 0.0,
                   "lookup_kept": s["lookup_accepted"] / s["lookup_chains"] if s["lookup_chains"] else 0.0,
                   "shared_lookup_share": s["shared_lookup_chains"] / s["request_steps"] if s["request_steps"] else 0.0,
                   "shared_lookup_kept": (s["shared_lookup_accepted"] / s["shared_lookup_chains"]
                                          if s["shared_lookup_chains"] else 0.0),
                   "ms_per_step": where_step_time_goes(s, s["seconds"])}
            for name, s in sums.items()}


def fill_shared_index(address: str, prompts: list[list[int]], tokens: int) -> float:
    """Serve ``prompts`` target-only, 16 at a time, into the coordinator's shared index: the
    earlier traffic of a server that has run a while. Returns the seconds it took."""
    start = time.perf_counter()
    generate_all(connect(address), [make_request(p, tokens, k=0, shared_lookup=True) for p in prompts],
                 concurrency=16, timeout=1200)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--prompt-start", type=int, default=16000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--k-policy", default=None, help="the coordinator's policy (default: the launcher's default)")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--threads", type=int, default=2, help="threads of the transformers baseline")
    parser.add_argument("--threads-per-service", type=int, default=None, help="as specbatch up's --threads")
    parser.add_argument("--weights", default="auto", help="as specbatch up's flag (default: auto)")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers generate()")
    parser.add_argument("--leaves", default="0", help="comma-separated leaf counts: one speculative mode each, "
                        "every request verifying that many; 'policy': the coordinator's --leaves-most, as many "
                        "as its policy chooses")
    parser.add_argument("--leaves-most", type=int, default=3, help="the coordinator's --leaves (for 'policy')")
    parser.add_argument("--prompt-lookup", default="6", help="comma-separated lengths N or N:LEAVES (LEAVES as "
                        "--leaves; default 0): one more speculative mode each, drafts copied from the request's history where its last tokens occurred "
                        "before (at most that many, and twice the step's k at batch 1), the draft asked otherwise")
    parser.add_argument("--shared-lookup", type=int, default=0, metavar="TOKENS",
                        help="the coordinator's shared lookup index size; each lookup mode gets a twin that uses it "
                             "(default 0: none)")
    parser.add_argument("--shared-warmup", type=int, default=256, help="prompts served into the index first")
    parser.add_argument("--shared-warmup-start", type=int, default=16400,
                        help="ShareGPT conversation the warm-up prompts start at")
    parser.add_argument("--grpc-only", action="store_true", help="the coordinator calls the services through gRPC, "
                        "not their local sockets")
    results.add_output_flags(parser, "batch1")
    args = parser.parse_args()

    tokenizer = load_tokenizer(ModelSpec())
    prompts = chat_prompts(tokenizer, sharegpt_prompts(4 * args.prompts, args.prompt_start), args.max_prompt_tokens)
    prompts = list({tuple(p): p for p in prompts}.values())[: args.prompts]  # a prompt sent twice is timed once
    baseline = None if args.no_baseline else transformers_generate(prompts, args.tokens, args.threads)
    if baseline:
        print(f"transformers generate(), fp32: {baseline:.1f} tok/s", flush=True)
    leaf_counts = [None if n == "policy" else int(n) for n in args.leaves.split(",")]
    # The coordinator looks nothing up unless a mode asks (its requests' own prompt_lookup).
    options = StackOptions(max_batch_size=8, threads=args.threads_per_service, prompt_lookup=0,
                           shared_lookup=args.shared_lookup, local_sockets=not args.grpc_only, weights=args.weights,
                           leaves=args.leaves_most if None in leaf_counts or ":policy" in args.prompt_lookup else 0)
    if args.k_policy:
        options.k_policy, options.profile = args.k_policy, args.profile
    names = {n: "speculative" + (f", {n} leaves" if n else f", the policy's leaves (<= {args.leaves_most})"
                                 if n is None else "") for n in leaf_counts}
    fields = {n: {"k": None, "leaves": n} for n in leaf_counts}
    lookups = [n for n in args.prompt_lookup.split(",") if n]
    for n in lookups:  # "N" or "N:LEAVES" (LEAVES a count or "policy", as --leaves)
        most, _, leaves = n.partition(":")
        names[f"lookup{n}"] = f"speculative, prompt lookup (<= {most} tokens)" + (f", leaves {leaves}" if leaves else "")
        fields[f"lookup{n}"] = {"k": None, "leaves": None if leaves == "policy" else int(leaves or 0),
                                "prompt_lookup": int(most)}
    if args.shared_lookup:  # every mode kept out of the shared index, but the lookup modes' twins
        for n in lookups:
            names[f"lookup{n}shared"] = names[f"lookup{n}"] + ", shared"
            fields[f"lookup{n}shared"] = {**fields[f"lookup{n}"], "shared_lookup": True}
        lookups += [f"{n}shared" for n in lookups]
        for n in fields:
            fields[n].setdefault("shared_lookup", False)
    leaf_counts += [f"lookup{n}" for n in lookups]  # the speculative modes
    with LocalProcesses(options) as stack:
        if args.shared_lookup:
            timed = set(map(tuple, prompts))
            warmup = [ids for ids in chat_prompts(tokenizer, sharegpt_prompts(2 * args.shared_warmup,
                                                                               args.shared_warmup_start),
                                                  args.max_prompt_tokens) if tuple(ids) not in timed][: args.shared_warmup]
            seconds = fill_shared_index(stack.address, warmup, args.tokens)
            print(f"shared index: {len(warmup)} other prompts served into it first ({seconds:.0f} s)", flush=True)
        modes = served(stack.address, prompts, args.tokens,
                       {"target-only": {"k": 0, **({"shared_lookup": False} if args.shared_lookup else {})},
                        **{names[n]: fields[n] for n in leaf_counts}})
    target_only = modes["target-only"]
    policy = stack.options.k_policy
    print(f"services, target-only (k=0): {target_only['tokens_per_second']:.1f} tok/s; k policy {policy}, weights "
          f"{stack.forms}: " + ", ".join(f"{names[n]} {modes[names[n]]['tokens_per_second']:.1f}"
                                                               for n in leaf_counts), flush=True)
    rows = {
        **({"transformers generate(), fp32": baseline} if baseline else {}),
        "services, target-only (k=0)": target_only["tokens_per_second"],
        **{f"services, {policy}" + names[n][len("speculative"):]: modes[names[n]]["tokens_per_second"]
           for n in leaf_counts},
    }
    print(f"\n## batch 1, greedy, {len(prompts)} held-out ShareGPT prompts x {args.tokens} tokens\n")
    print("| mode | tok/s | " + " | ".join(f"{names[n]} / this" for n in leaf_counts) + " |")
    print("|---|---|" + "---|" * len(leaf_counts))
    for name, tps in rows.items():
        print(f"| {name} | {tps:.1f} | " + " | ".join(f"{modes[names[n]]['tokens_per_second'] / tps:.2f}x"
                                                   for n in leaf_counts) + " |")
    for n in leaf_counts:
        mode = modes[names[n]]
        print(f"\n{names[n]}: acceptance {mode['acceptance']:.2f} (kept leaves included), tokens per step "
              f"{mode['tokens_per_step']:.2f}" + (f", leaf hit rate {mode['leaf_hit_rate']:.2f}" if n != 0 and not str(n).startswith("lookup") else "")
              + (f", steps drafted by lookup {mode['lookup_share']:.2f} keeping {mode['lookup_kept']:.2f} tokens each"
                 if str(n).startswith("lookup") else "")
              + (f", of which from the shared index {mode['shared_lookup_share']:.2f} keeping "
                 f"{mode['shared_lookup_kept']:.2f} each" if str(n).endswith("shared") else ""))
    print("(targets: >= 1.5x target-only through the services, >= 1.5x transformers generate())")
    print("\n## where a decode step's time goes (ms per step)\n")
    print("| part | target-only (k=0) | " + " | ".join(names[n] for n in leaf_counts) + " |")
    print("|---|---|" + "---|" * len(leaf_counts))
    for part in target_only["ms_per_step"]:
        print(f"| {part} | {target_only['ms_per_step'][part]:.2f} | "
              + " | ".join(f"{modes[names[n]]['ms_per_step'][part]:.2f}" for n in leaf_counts) + " |")
    results.write("batch1", {"tokens_per_second": rows, "modes": modes,
                             "weights": {"target": stack.forms.target, "draft": stack.forms.draft},
                             "k_policy": stack.options.k_policy, "profile": stack.options.profile,
                             "prompts": len(prompts), "tokens": args.tokens},
                  out=args.out, variant=args.variant, device=stack.options.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

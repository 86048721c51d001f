"""``specbatch demo``: start the three services, stream a few chat answers, report, stop."""

from __future__ import annotations

import statistics

from specbatch.commands.prompts import CHAT_PROMPTS
from specbatch.kernels import forms
from specbatch.rpc.client import connect, generate, generate_all, make_request
from specbatch.stack.defaults import services_device, stack_options
from specbatch.stack.processes import LocalProcesses

TIMED_RUNS = 3  # each prompt's runs of each mode behind the table


def _report(result) -> str:
    s = result.stats
    return (f"{s.generated_tokens} tokens, {result.tokens_per_second:.1f} tok/s, acceptance {result.acceptance:.2f} "
            f"({s.draft_tokens_accepted}/{s.draft_tokens_proposed} drafted tokens accepted, {s.steps} steps), "
            f"first token {result.first_token_seconds * 1000:.0f} ms, finish: {result.finish}")


def run_demo(args) -> int:
    prompts = CHAT_PROMPTS[:3]
    print("starting target, draft and coordinator on loopback (the first run converts the embedded model) …",
          flush=True)
    with LocalProcesses(stack_options(args)) as processes:
        stub = connect(processes.address)
        print(f"serving on {processes.address}, k policy {processes.options.k_policy}\n", flush=True)
        # One short request first, so that neither mode of the first prompt pays the warm-up.
        generate(stub, make_request(prompts[0], 4, chat=True))
        rows = []
        for prompt in prompts:
            print(f"> {prompt}\n", flush=True)
            result = generate(stub, make_request(prompt, args.max_new_tokens, chat=True),
                              on_response=lambda r: print(r.text, end="", flush=True))
            print(f"\n  [{_report(result)}]", flush=True)
            # The same prompt target-only (k = 0) through the same services, the baseline, and
            # speculative again: TIMED_RUNS runs of each, quietly, taking turns (one short
            # answer's tok/s strays by 2x between runs: a stray prefill, the first call of a path).
            times = {k: [] for k in (0, None)}
            for _ in range(TIMED_RUNS):
                for k, runs in times.items():
                    runs.append(generate(stub, make_request(prompt, args.max_new_tokens, chat=True, k=k)))
            speeds = {k: statistics.median(run.tokens_per_second for run in runs) for k, runs in times.items()}
            print(f"  [tok/s, median of {TIMED_RUNS} runs: target-only {speeds[0]:.1f}, speculative {speeds[None]:.1f}]\n",
                  flush=True)
            alone = times[0][0].token_ids
            rows.append((prompt, speeds, all(run.token_ids == alone for run in [result, *times[None]])))
        print("| prompt | target-only tok/s | speculative tok/s | speed-up | same tokens |\n|---|---|---|---|---|")
        for prompt, speeds, same in rows:
            speedup = speeds[None] / speeds[0] if speeds[0] else 0.0
            print(f"| {prompt[:40]} | {speeds[0]:.1f} | {speeds[None]:.1f} | {speedup:.2f}x | {'yes' if same else 'no'} |",
                  flush=True)
        print(f"(tok/s: the median of {TIMED_RUNS} runs of each, the modes taking turns)", flush=True)
        form = processes.forms.target if services_device(processes.options) == "cpu" else "model"
        if form in forms.SIXTEEN_BIT_FORMS | {"bf16"}:  # the engine's own kernels: a row's bits never depend on the batch
            kv = ", keys and values in bf16" if forms.kv_bf16(form) else ""
            print(f"(the target runs {form}{kv}, row-exact: the two must be the same tokens)\n", flush=True)
        else:
            print("(where a multiply's results depend on its row count, as bf16's on oneDNN do, the two may part "
                  "where the target's two best tokens nearly tie: docs/exactness.md)\n", flush=True)
        print(f"the same {len(prompts)} prompts at once, batched by the coordinator:", flush=True)
        results = generate_all(stub, [make_request(p, args.max_new_tokens, chat=True) for p in prompts])
        for prompt, result in zip(prompts, results):
            print(f"  {prompt[:40]:<40}  {_report(result)}", flush=True)
        print("\nstopping the services …", flush=True)
    print("done.")
    return 0

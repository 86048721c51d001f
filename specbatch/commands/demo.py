"""``specbatch demo``: start the three services, stream a few chat answers, report, stop."""

from __future__ import annotations

from ..client import connect, generate, generate_all, make_request
from .launcher import LocalProcesses, kv_bf16, services_cpu_form, stack_options
from ..prompts import CHAT_PROMPTS


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
            # The same prompt target-only (k = 0) through the same services: the baseline.
            alone = generate(stub, make_request(prompt, args.max_new_tokens, chat=True, k=0))
            print(f"  [target-only: {alone.tokens_per_second:.1f} tok/s]\n", flush=True)
            rows.append((prompt, alone, result))
        print("| prompt | target-only tok/s | speculative tok/s | speed-up | same tokens |\n|---|---|---|---|---|")
        for prompt, alone, result in rows:
            speedup = result.tokens_per_second / alone.tokens_per_second if alone.tokens_per_second else 0.0
            print(f"| {prompt[:40]} | {alone.tokens_per_second:.1f} | {result.tokens_per_second:.1f} | {speedup:.2f}x | "
                  f"{'yes' if alone.token_ids == result.token_ids else 'no'} |", flush=True)
        form = services_cpu_form(processes.options) if processes.options.device in (None, "cpu") else ""
        if form.startswith("float32+"):  # the engine's own kernels: a row's bits never depend on the batch
            kv = ", keys and values in bf16" if kv_bf16(processes.options) else ""
            print(f"(the services run {form}{kv}, row-exact: the two must be the same tokens)\n", flush=True)
        else:
            print("(where a multiply's results depend on its row count, as bf16's on oneDNN do, the two may part "
                  "where the target's two best tokens nearly tie: docs/engine.md)\n", flush=True)
        print(f"the same {len(prompts)} prompts at once, batched by the coordinator:", flush=True)
        results = generate_all(stub, [make_request(p, args.max_new_tokens, chat=True) for p in prompts])
        for prompt, result in zip(prompts, results):
            print(f"  {prompt[:40]:<40}  {_report(result)}", flush=True)
        print("\nstopping the services …", flush=True)
    print("done.")
    return 0

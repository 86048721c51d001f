"""The embedded default against llama.cpp on its own file: SmolLM2-135M-Instruct's Q4_1 GGUF,
greedy, the same prompts, threads and new tokens (the EOS ignored), the prefill counted.

Three modes take turns each round (the order rotated): llama.cpp (the ik_llama.cpp fork's
prebuilt wheel, ``ik-llama-cpp-python``), and through ``specbatch up`` with the stack's defaults
target-only decoding (k = 0) and the default policy. Two prompt sets: chat questions in the chat
template and code-completion requests (longer prompts, plain text). Two levels: batch 1 (one
request at a time) and concurrency 8, where llama.cpp decodes 8 sequences in one batch (its
``n_seq_max``) and specbatch serves 8 streams.

llama.cpp runs in a process of its own, in an environment of its own: ``make llamacpp-env``
makes ``.venv-llamacpp`` (the wheel and numpy; nothing of it enters the product's dependencies).
Its Python ``sample()`` copies every logit into a list per token (tens of ms), so the worker
reads the logits in place and takes the argmax with numpy: llama.cpp at engine speed. Every
llama.cpp call gets all the cores (``--threads``, default: the cores this process may use);
specbatch's services take half each and go wide, as ``specbatch up`` decides.

specbatch's requests ask for their whole output in one response (``stream_interval`` 0), as the
llama.cpp worker hands back whole answers: a client reading a stream token by token pays a message
a step on the same cores (``--stream-interval 1`` measures that instead).

Prints tokens per second per mode, prompt set and level, the ratios the targets name (the
default and target-only over llama.cpp, round by round with 95 % intervals), what speculation
gave (the default over target-only) with the tokens a decode step the default kept per sequence
(1: it ran k = 0 throughout), and the greedy outputs of the default that differ from target-only
decoding (counted; 0 expected). ``--fixed-k 1,2`` adds a mode a k, each request drafting that k
(held against the default: what its policy's choice gave beside a fixed one). Writes
benchmarks/results/<machine>/vs-llamacpp.json.

    make llamacpp-env && .venv/bin/python benchmarks/vs_llamacpp.py [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

# Code-completion requests: the start of a function or a file, continued as plain text.
CODE_PROMPTS = [
    'def fibonacci(n: int) -> list[int]:\n    """Return the first n Fibonacci numbers.\n\n'
    '    >>> fibonacci(5)\n    [0, 1, 1, 2, 3]\n    """\n',
    'import csv\n\n\ndef read_rows(path):\n'
    '    """Read a CSV file with a header row and return a list of dicts, one per row,\n'
    '    with the numeric columns converted to floats."""\n',
    "class Stack:\n    \"\"\"A last-in, first-out stack backed by a Python list.\"\"\"\n\n    def __init__(self):\n"
    "        self.items = []\n\n    def push(self, item):\n",
    "#include <stdio.h>\n#include <string.h>\n\n"
    "/* Reverse a string in place and return it. */\nchar *reverse(char *s) {\n",
    'function debounce(fn, wait) {\n  // Return a function that calls fn only after wait milliseconds have passed\n'
    '  // without another call.\n',
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n        return False\n",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\n",
    'def binary_search(items, target):\n'
    '    """Return the index of target in the sorted list items, or -1 if it is absent."""\n'
    '    low, high = 0, len(items) - 1\n',
]


# ---- the llama.cpp worker (runs in .venv-llamacpp: numpy and ik_llama_cpp only) ---------------------

def batch_of(entries: list[tuple[int, int, int, bool]]):
    """A llama_batch of (token, position, sequence, wants logits); free it with llama_batch_free.
    (Also benchmarks/form_fidelity.py's.)"""
    from ik_llama_cpp import _ctypes_api as C

    batch = C.llama_batch_init(len(entries), 0, 1)
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, int(logits)
        batch.seq_id[i][0] = seq
    return batch


def worker() -> None:
    """Reads one JSON request a line ({"prompts", "new_tokens", "concurrency"}), decodes them
    greedily (``concurrency`` sequences a batch) and answers {"tokens", "seconds"}."""
    import numpy as np
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel

    # llama.cpp logs to the process's stdout from C: the answers go to a copy of it, its logs to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    gguf, threads = sys.argv[2], int(sys.argv[3])
    model = IkModel(gguf)
    vocab = model.n_vocab
    contexts: dict[int, IkContext] = {}

    def argmax(ctx, i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx.ctx, i), shape=(vocab,))))

    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompts, new_tokens, width = request["prompts"], request["new_tokens"], request["concurrency"]
        if width not in contexts:  # a unified cache for `width` sequences of the longest prompt and answer
            # (flash attention off: its iqk kernel asserts S > 0 in this wheel on an AVX512_VNNI CPU)
            contexts[width] = IkContext(model, n_ctx=width * 1024, n_threads=threads, n_seq_max=width,
                                        flash_attn=False)
        ctx = contexts[width]
        outputs: list[list[int]] = [[] for _ in prompts]
        start = time.perf_counter()
        for first in range(0, len(prompts), width):
            group = list(range(first, min(first + width, len(prompts))))
            ctx.kv_cache_clear()
            for seq, i in enumerate(group):  # prefill each prompt: its last token's logits give the first
                batch = batch_of([(t, p, seq, p == len(prompts[i]) - 1) for p, t in enumerate(prompts[i])])
                if ctx.decode(batch):
                    raise RuntimeError("llama_decode failed in a prefill")
                C.llama_batch_free(batch)
                outputs[i].append(argmax(ctx, len(prompts[i]) - 1))
            for _ in range(new_tokens - 1):  # then one token a sequence per decode, all at once
                batch = batch_of([(outputs[i][-1], len(prompts[i]) + len(outputs[i]) - 1, seq, True)
                                  for seq, i in enumerate(group)])
                if ctx.decode(batch):
                    raise RuntimeError("llama_decode failed")
                C.llama_batch_free(batch)
                for row, i in enumerate(group):
                    outputs[i].append(argmax(ctx, row))
        print(json.dumps({"tokens": outputs, "seconds": time.perf_counter() - start}), file=answers, flush=True)


class LlamaCpp:
    """The worker in its own environment's Python."""

    def __init__(self, python: str, gguf: str, threads: int):
        import subprocess

        self.process = subprocess.Popen([python, __file__, "--worker", gguf, str(threads)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if not json.loads(self.process.stdout.readline()).get("ready"):
            raise RuntimeError("the llama.cpp worker did not start")

    def run(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> tuple[list[list[int]], float]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens,
                                             "concurrency": concurrency}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


# ---- the run ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import argparse
    import statistics

    from specbatch.commands import results
    from specbatch.commands.bench.pairs import paired_ratio
    from specbatch.commands.prompts import CHAT_PROMPTS, chat_prompts
    from specbatch.models.embedded import EMBEDDED, EMBEDDED_GGUF
    from specbatch.models.loading import ModelSpec, embedded_gguf_folder, load_tokenizer
    from specbatch.rpc.client import connect, generate_all, make_request
    from specbatch.stack.defaults import available_cores, stack_options
    from specbatch.stack.processes import LocalProcesses

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python",
                        help="the Python of an environment with ik-llama-cpp-python (make llamacpp-env)")
    parser.add_argument("--threads", type=int, default=available_cores(), help="llama.cpp's threads")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens a request (the EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts of each set a round")
    parser.add_argument("--levels", default="1,8", help="concurrency levels")
    parser.add_argument("--stream-interval", type=int, default=0,
                        help="specbatch's requests' stream_interval: 0 (default) the whole output in one "
                        "response, as llama.cpp's worker returns it; 1 a message a step")
    parser.add_argument("--up", default="", help="flags for specbatch up beside its defaults, one string "
                        "(e.g. \"--weights bf16-dot\": a form other than the machine's)")
    parser.add_argument("--fixed-k", default="", help="comma-separated ks also served as modes of their own "
                        "(each request drafting that k), to hold the default policy's choice against")
    results.add_output_flags(parser, "vs-llamacpp")
    args = parser.parse_args(argv)
    if not os.path.exists(args.llamacpp_python):
        parser.error(f"no {args.llamacpp_python}: make llamacpp-env first (or pass --llamacpp-python)")

    from specbatch.config.options import UP, add_options

    up = add_options(argparse.ArgumentParser(), UP).parse_args(shlex.split(args.up))
    gguf = str(embedded_gguf_folder() / EMBEDDED_GGUF)
    tokenizer = load_tokenizer(ModelSpec(EMBEDDED))
    sets = {"chat": chat_prompts(tokenizer, CHAT_PROMPTS, 512)[: args.prompts],
            "code": [tokenizer(text)["input_ids"] for text in CODE_PROMPTS][: args.prompts]}
    levels = [int(c) for c in args.levels.split(",")]
    fixed = [int(k) for k in args.fixed_k.split(",") if k.strip()]
    modes = ["llama.cpp", "target-only", "default", *(f"k={k}" for k in fixed)]
    llama = LlamaCpp(args.llamacpp_python, gguf, args.threads)
    times: dict = {}  # (set, level, mode) -> [tok/s per round]
    outputs: dict = {}  # (set, level, mode) -> tokens of the last round
    steps: dict = {}  # (set, level) -> [(tokens, decode steps) of the default's requests] a round
    with LocalProcesses(stack_options(up)) as stack:
        client = connect(stack.address)
        policy = stack.options.k_policy
        print(f"llama.cpp: {EMBEDDED_GGUF}, {args.threads} threads | specbatch: {stack.forms.target} target, "
              f"{stack.forms.draft} draft, default policy {policy} | {args.tokens} new tokens a request", flush=True)

        def serve(mode: str, prompts: list[list[int]], level: int) -> tuple[list[list[int]], float, int]:
            """The outputs, seconds and decode steps (0 for llama.cpp) of one mode over ``prompts``."""
            if mode == "llama.cpp":
                return *llama.run(prompts, args.tokens, level), 0
            k = 0 if mode == "target-only" else int(mode[2:]) if mode.startswith("k=") else None
            requests = [make_request(p, args.tokens, ignore_eos=True, k=k, stream_interval=args.stream_interval)
                        for p in prompts]
            start = time.perf_counter()
            done = generate_all(client, requests, concurrency=level, timeout=600)
            return [list(r.token_ids) for r in done], time.perf_counter() - start, sum(r.stats.steps for r in done)

        for name, prompts in sets.items():  # a warm-up of each path, not timed
            for mode in modes:
                serve(mode, prompts[:1], 1)
        for r in range(args.rounds):
            for level in levels:
                for name, prompts in sets.items():
                    for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
                        tokens, seconds, stepped = serve(mode, prompts, level)
                        if mode == "default":
                            steps.setdefault((name, level), []).append((sum(map(len, tokens)), stepped))
                        times.setdefault((name, level, mode), []).append(sum(map(len, tokens)) / seconds)
                        outputs[(name, level, mode)] = tokens
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    llama.close()

    rows, mismatches = [], 0
    for level in levels:
        for name in sets:
            cell = {mode: times[(name, level, mode)] for mode in modes}
            row = {"prompts": name, "concurrency": level,
                   **{f"{mode} tok/s": statistics.fmean(cell[mode]) for mode in modes}}
            for mode in ("default", "target-only"):
                ratio = paired_ratio(cell[mode], cell["llama.cpp"])
                row[f"{mode} / llama.cpp"] = ratio["ratio"]
                row[f"{mode} / llama.cpp 95 %"] = f"{ratio['low']:.3f}-{ratio['high']:.3f}"
            # What speculation itself gave, and how much the default speculated (1: k = 0 throughout).
            gain = paired_ratio(cell["default"], cell["target-only"])
            row["default / target-only"] = f"{gain['ratio']:.2f} ({gain['low']:.2f}-{gain['high']:.2f})"
            generated, stepped = (sum(column) for column in zip(*steps[(name, level)]))
            row["default tokens a step"] = round(generated / stepped, 2) if stepped else None
            for k in fixed:
                against = paired_ratio(cell["default"], cell[f"k={k}"])
                row[f"default / k={k}"] = f"{against['ratio']:.2f} ({against['low']:.2f}-{against['high']:.2f})"
            differing = sum(a != b for a, b in zip(outputs[(name, level, "default")],
                                                   outputs[(name, level, "target-only")]))
            agree = sum(a == b for a, b in zip(outputs[(name, level, "llama.cpp")],
                                               outputs[(name, level, "target-only")]))
            row["default ≠ target-only"] = differing
            row["llama.cpp = target-only"] = f"{agree} of {len(sets[name])}"
            mismatches += differing
            for k in fixed:  # every mode's greedy output is target-only decoding's
                row[f"k={k} ≠ target-only"] = sum(a != b for a, b in zip(outputs[(name, level, f"k={k}")],
                                                                        outputs[(name, level, "target-only")]))
                mismatches += row[f"k={k} ≠ target-only"]
            rows.append(row)
    print(results.table(rows))
    print(f"greedy outputs of the default that differ from target-only decoding: {mismatches}")
    results.write("vs-llamacpp", {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
                                  "stream_interval": args.stream_interval,
                                  "policy": policy, "rows": rows, "mismatches": mismatches,
                                  "per_round": {f"{n}/c={c}/{m}": v for (n, c, m), v in times.items()},
                                  # whether the default speculated in each round (1: k = 0 throughout)
                                  "default_tokens_a_step_per_round": {
                                      f"{n}/c={c}": [round(g / s, 3) if s else None for g, s in rounds]
                                      for (n, c), rounds in steps.items()}},
                  args.out, args.variant)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
    else:
        sys.exit(main())

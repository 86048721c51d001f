#!/usr/bin/env python3
"""Two builds of the CPU kernels, one process, taking turns: the embedded target's forward (a verify
step's, ``--context`` tokens cached) on the kernels of a git revision (``--base``, default HEAD)
against the working tree's.

A kernel change moves a step by a few percent, and this machine's speed drifts by more than that
between runs: so both builds serve the same engine (the same packed weights and KV pool), their
verify calls alternate (ABAB, then BABA), and the ratio is the median of each pair's. Every pair's
logits must be bitwise equal, or the run stops: a kernel change may move time, never a result.

    .venv/bin/python benchmarks/kernels_ab.py [--base REV] [--new 1,2,3] [--rounds 200] [--context 128]

``--ordinary-pages``: the same kernels on both sides; the base reads a copy of the packed weights
in ordinary 4 KB pages, the new side the weights where the engine placed them (specbatch/kernels/
pages.py: memory backed by 2 MB pages where the OS allows).

Writes benchmarks/results/<machine>/kernels-ab.json (or ``--out``; ``--variant`` names runs apart).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# As the target service runs under `specbatch up` with the draft in its process (docs/cpu-kernels.md,
# "Threads and wide calls"): set before torch loads libgomp.
from specbatch.stack.defaults import ALONE_SPINCOUNT  # noqa: E402 (imports no torch)

os.environ.setdefault("GOMP_SPINCOUNT", str(ALONE_SPINCOUNT))

import torch  # noqa: E402

from specbatch.commands import results  # noqa: E402
from specbatch.engine.batch import SequenceInput  # noqa: E402
from specbatch.engine.engine import Engine  # noqa: E402
from specbatch.engine.model_thread import ModelThread  # noqa: E402
from specbatch.kernels import build  # noqa: E402
from specbatch.models.embedded import EMBEDDED  # noqa: E402
from specbatch.models.loading import ModelSpec, load_model  # noqa: E402


def library_at(revision: str, scratch: Path):
    """The kernels of ``revision``, built with this machine's flags and loaded as the services load theirs."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "specbatch/kernels/c"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(scratch, filter="data")
    sources = tuple(scratch / "specbatch/kernels/c" / path.name for path in build.SOURCES)
    return build.load(build.build(scratch, sources=sources))


def ordinary_copies(forward) -> dict:
    """{address of a packed weight: a copy of it in ordinary pages}, for every linear layer."""
    from specbatch.commands.bench.engine import _panels

    return {linear.panels.data_ptr(): torch.empty_like(linear.panels).copy_(linear.panels)
            for linear in _panels(forward)}


def kernel_arguments(forward) -> list:
    """Every linear layer's kernel arguments: its own, and the decoder layers' copies of them."""
    from specbatch.commands.bench.engine import _panels

    return [linear.args for linear in _panels(forward)] + [
        getattr(layer, part) for layer in forward.decoder_layers._layers for part in ("qkv", "o", "gate_up", "down")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision whose kernels are the baseline")
    parser.add_argument("--new", default="1,2,3", help="tokens fed per verify (1: target-only decoding)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--context", type=int, default=128, help="tokens cached before each verify")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ordinary-pages", action="store_true",
                        help="base: this tree's kernels on a copy of the weights in ordinary pages")
    results.add_output_flags(parser, "kernels-ab")
    args = parser.parse_args(argv)
    from target_service.verifier import VerifyItem

    thread = ModelThread()  # every forward on one thread: one OpenMP team (docs/cpu-kernels.md)

    def setup():
        torch.set_num_threads(args.threads)
        weights = "q4_1" if build.blocks_available() else "bf16"
        engine = Engine(load_model(ModelSpec(EMBEDDED), "cpu", torch.float32), weights=weights, kv_bf16=True,
                        model_thread=thread)
        engine.forward.wide_threads = args.threads
        engine.prefill([SequenceInput("ab", 0, [100 + t % 1000 for t in range(args.context)])])
        if args.ordinary_pages:
            return engine, weights, {"base": build._library(), "new": build._library()}
        scratch = Path(tempfile.mkdtemp(prefix="kernels-ab-"))
        return engine, weights, {"base": library_at(args.base, scratch), "new": build._library()}

    engine, weights, libraries = thread.submit(setup).result()
    # --ordinary-pages: each side points the kernels at its own copy of the weights (address -> address).
    copies = ordinary_copies(engine.forward) if args.ordinary_pages else {}
    moves = {"base": {placed: copy.data_ptr() for placed, copy in copies.items()},
             "new": {copy.data_ptr(): placed for placed, copy in copies.items()}}
    arguments = kernel_arguments(engine.forward) if copies else []

    def step(library, items, name):
        for argument in arguments:
            argument.packed = moves[name].get(argument.packed, argument.packed)
        engine.forward.decoder_layers._library = library
        engine.forward.head._multiply = library.panel_linear_multiply
        start = time.perf_counter()
        # As a verify: logits at every token fed (the head's rows cost as the layers' do).
        logits = engine.start([item.seq for item in items]).prefill(len(items[0].seq.tokens))
        seconds = time.perf_counter() - start
        engine.rollback("ab", args.context)
        return seconds, logits

    def measure(new: int) -> dict:
        items = [VerifyItem(SequenceInput("ab", args.context, [11 + t for t in range(new)]))]
        times = {"base": [], "new": []}
        for round_ in range(args.rounds + 5):
            order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
            out = {}
            for name in order:
                seconds, out[name] = step(libraries[name], items, name)
                if round_ >= 5:
                    times[name].append(seconds)
            if not torch.equal(out["base"], out["new"]):
                raise SystemExit(f"the two builds' logits differ at {new} tokens fed")
        ratio = statistics.median(n / b for n, b in zip(times["new"], times["base"]))
        return {"tokens_fed": new, "base_ms": statistics.median(times["base"]) * 1e3,
                "new_ms": statistics.median(times["new"]) * 1e3, "paired_ratio": ratio}

    print("| tokens fed | base ms | new ms | new / base (median of pairs) |\n|---|---|---|---|")
    rows = []
    for new in (int(n) for n in args.new.split(",")):
        row = thread.submit(measure, new).result()
        rows.append(row)
        print(f"| {new} | {row['base_ms']:.2f} | {row['new_ms']:.2f} | {row['paired_ratio']:.3f} |")
    base = ("ordinary-pages" if args.ordinary_pages else
            subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], capture_output=True, text=True).stdout.strip())
    results.write("kernels-ab", {"base": base,
                                 "weights": weights, "context": args.context, "rounds": args.rounds,
                                 "threads": args.threads, "rows": rows}, args.out, args.variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

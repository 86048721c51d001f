"""A bounded soak test of the whole stack as processes on loopback (not part of CI).

Starts target, draft and coordinator (specbatch.stack.processes), warms up, then keeps N concurrent
client streams busy with short requests for a fixed time, stepping N through 64, 128 and 256 (or
a fixed --concurrency). The coordinator gets a small queue (--max-queue), so the highest levels do
overflow it: clients then wait as long as the ``retry-after-ms`` trailer of RESOURCE_EXHAUSTED says
(plus jitter) and retry, and the retries are counted.

Reports, per level and in all: requests completed, errors by status code, RESOURCE_EXHAUSTED
refusals (with and without a retry hint) and retries, latency p50/p99 (the successful attempt, and
end to end with retries), TTFT, tokens/s; and for each service process its RSS, threads and open
files after warm-up and at the end, with the RSS drift. After the run the stack must be idle: no
request running or waiting, no sequence left in either service's cache.

    .venv/bin/python benchmarks/soak.py                    # 2 minutes, the embedded models
    .venv/bin/python benchmarks/soak.py --tiny --seconds 20 # a random tiny model: a quick check

Writes the report to benchmarks/results/<machine>/soak.json (with --tiny soak-tiny.json), or ``--out``."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from rich.console import Console
from soak_report import Outcome, Sampler, memory_drift, process_sample, report, summary, wait_idle

from specbatch.commands import results
from specbatch.rpc.client import make_request
from specbatch.rpc.tls import open_channel
from specbatch.stack.defaults import StackOptions, free_port
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as pb
from specbatch.v1 import generation_pb2_grpc as pb_grpc

STREAMS_PER_CHANNEL = 32  # client streams share a few HTTP/2 connections, as many clients would


def write_tiny_model(folder: Path, vocab: int = 512) -> None:
    """A random 4-layer Llama and a word-level tokenizer: loads in a second, steps in milliseconds."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(folder)


class Schedule:
    """Concurrency over time: ``levels[i]`` streams during the i-th slice of ``seconds``. Streams
    carry on across a step (no drain between levels); after the last slice no new request starts."""

    def __init__(self, levels: list[int], seconds: float):
        self.levels, self.seconds = levels, seconds
        self.slice = seconds / len(levels)
        self.start = 0.0

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def concurrency_at(self, now: float) -> int:
        index = int((now - self.start) // self.slice)
        return self.levels[index] if 0 <= index < len(self.levels) else 0

    def windows(self):
        for i, concurrency in enumerate(self.levels):
            yield concurrency, self.start + i * self.slice, self.start + (i + 1) * self.slice


class Prompts:
    def __init__(self, args, vocab: int):
        self.chat: list[str] = []
        self.vocab = vocab
        if not args.tiny and args.prompts == "sharegpt":
            from specbatch.commands.prompts import sharegpt_prompts

            self.chat = sharegpt_prompts(args.prompt_count, args.prompt_start, max_chars=args.prompt_chars)

    def request(self, rng: random.Random, args) -> pb.GenerateRequest:
        n = rng.randint(args.min_new_tokens, args.max_new_tokens)
        sampled = rng.random() < args.sampled_share
        options = dict(temperature=0.7, top_p=0.9, seed=rng.getrandbits(63)) if sampled else {}
        if self.chat:
            return make_request(rng.choice(self.chat), n, chat=True, ignore_eos=True, **options)
        prompt = [1] + [rng.randrange(4, self.vocab) for _ in range(rng.randint(8, 64))]
        return make_request(prompt, n, ignore_eos=True, **options)


def retry_after(error: grpc.RpcError) -> float | None:
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return int(value) / 1000
            except ValueError:
                return None
    return None


def send(stub, request: pb.GenerateRequest, outcome: Outcome, args, end: float, rng: random.Random,
         stop: threading.Event) -> None:
    """One request until it succeeds or fails; RESOURCE_EXHAUSTED is retried after the hinted wait."""
    outcome.first_sent = time.monotonic()
    while True:
        outcome.attempts += 1
        sent = time.monotonic()
        try:
            for response in stub.Generate(request, timeout=args.request_timeout):
                if response.token_ids and outcome.ttft is None:
                    outcome.ttft = time.monotonic() - sent
                outcome.tokens += len(response.token_ids)
            outcome.ok, outcome.finished = True, time.monotonic()
            outcome.latency, outcome.end_to_end = outcome.finished - sent, outcome.finished - outcome.first_sent
            return
        except grpc.RpcError as error:
            outcome.code = error.code().name
            outcome.tokens, outcome.ttft = 0, None
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                outcome.messages.append(f"{outcome.code}: {error.details()}")
                return
            outcome.refused += 1
            hint = retry_after(error)
            if hint is None:
                outcome.unhinted += 1
                outcome.messages.append(f"no hint: {error.details()}")
                hint = 0.1
            wait = hint * rng.uniform(1.0, 1.5)  # as told, spread so that retries do not arrive at once
            if time.monotonic() + wait >= end or stop.wait(wait):
                outcome.abandoned = True
                return


def client(index: int, stub, schedule: Schedule, prompts: Prompts, args, outcomes: list[Outcome],
           stop: threading.Event) -> None:
    """Stream ``index``: sends requests one after another while the schedule has this many streams."""
    rng = random.Random(args.seed * 100_003 + index)
    while not stop.is_set():
        now = time.monotonic()
        if now >= schedule.end:
            return
        if index >= schedule.concurrency_at(now):
            stop.wait(0.2)
            continue
        outcome = Outcome()
        outcomes.append(outcome)  # list.append is atomic
        send(stub, prompts.request(rng, args), outcome, args, schedule.end, rng, stop)
        if outcome.abandoned:
            return  # its retry would come after the end: this stream is done


def run(stubs, schedule: Schedule, prompts: Prompts, args, stop: threading.Event, on_level=None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    schedule.start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i, stubs[i % len(stubs)], schedule, prompts, args, outcomes,
                                                     stop), daemon=True)
               for i in range(max(schedule.levels))]
    for thread in threads:
        thread.start()
    for concurrency, _, end in schedule.windows():
        if on_level:
            on_level(concurrency, schedule.slice)
        stop.wait(max(0.0, end - time.monotonic()))
    for thread in threads:
        thread.join()
    return outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="load time in all, split over the levels")
    parser.add_argument("--concurrency", type=int, help="one fixed number of streams (default: step through --levels)")
    parser.add_argument("--levels", default="64,128,256", help="concurrency steps when --concurrency is not given")
    parser.add_argument("--tiny", action="store_true", help="a random tiny model instead of the embedded ones")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-queue", type=int, default=128,
                        help="the coordinator's queue: small, so that the top level overflows it")
    parser.add_argument("--min-new-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sampled-share", type=float, default=0.5, help="share of sampled (vs greedy) requests")
    parser.add_argument("--prompts", choices=("sharegpt", "tokens"), default="sharegpt",
                        help="ShareGPT first turns as chat, or random token ids (always tokens with --tiny)")
    parser.add_argument("--prompt-start", type=int, default=16000)
    parser.add_argument("--prompt-count", type=int, default=256)
    parser.add_argument("--prompt-chars", type=int, default=600, help="longest ShareGPT prompt, characters")
    parser.add_argument("--warmup-seconds", type=float, default=10.0,
                        help="load at the max batch size before the first memory reading")
    parser.add_argument("--k-policy", default="fixed:3")
    parser.add_argument("--device")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    results.add_output_flags(parser, "soak")
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=170)
    levels = [args.concurrency] if args.concurrency else [int(c) for c in args.levels.split(",")]

    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    coordinator_flags = ["--max-queue", str(args.max_queue)]
    with tempfile.TemporaryDirectory(prefix="soak-tiny-") as tiny_folder:
        if args.tiny:
            write_tiny_model(Path(tiny_folder))
            options = StackOptions(target_model=tiny_folder, draft_model=tiny_folder, draft_layers=2, ports=ports,
                                   max_batch_size=args.max_batch_size, k_policy=args.k_policy, device=args.device,
                                   coordinator_flags=coordinator_flags)
        else:
            options = StackOptions(ports=ports, max_batch_size=args.max_batch_size, k_policy=args.k_policy,
                                   device=args.device, coordinator_flags=coordinator_flags)
        console.print("starting target, draft and coordinator (the first start converts the embedded model) …")
        started = time.monotonic()
        with LocalProcesses(options) as processes:
            console.print(f"serving after {time.monotonic() - started:.0f} s on {processes.address}")
            channels = [open_channel(processes.address)
                        for _ in range(max(1, -(-max(levels) // STREAMS_PER_CHANNEL)))]
            stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
            info = stubs[0].Info(pb.InfoRequest(), timeout=30)
            prompts = Prompts(args, vocab=512 if args.tiny else 49152)
            stop = threading.Event()

            console.print(f"warm-up: {args.warmup_seconds:.0f} s at {args.max_batch_size} streams")
            warm_schedule = Schedule([args.max_batch_size], args.warmup_seconds)
            warm = run(stubs, warm_schedule, prompts, args, stop)
            warm_summary = summary(args.max_batch_size, warm, warm_schedule.start, time.monotonic())
            start = process_sample(processes)
            schedule = Schedule(levels, args.seconds)
            with Sampler(processes) as sampler:
                outcomes = run(stubs, schedule, prompts, args, stop, on_level=lambda c, s: console.print(
                    f"{c} streams for {s:.0f} s …"))
                drained = time.monotonic()
                processes.check_alive()
                left = wait_idle(stubs[0], {"target": processes.target_address, "draft": processes.draft_address})
                end = process_sample(processes)
            for channel in channels:
                channel.close()
    rows = [summary(c, outcomes, a, b) for c, a, b in schedule.windows()]
    total = summary("all", outcomes, schedule.start, drained + 1e-6)
    result = {
        "models": f"{info.target_model} + {info.draft_model}", "k_policy": info.k_policy,
        "seconds": args.seconds, "max_batch_size": info.max_batch_size, "max_queue": info.max_queue,
        "new_tokens": [args.min_new_tokens, args.max_new_tokens], "sampled_share": args.sampled_share,
        "prompts": "tokens" if args.tiny or args.prompts == "tokens" else "sharegpt",
        "warmup": warm_summary, "levels": rows, "total": total,
        "drain_seconds": round(drained - schedule.end, 1),
        "processes": memory_drift(start, end, sampler.samples), "left_after": left,
        "rss_samples": sampler.samples,
    }
    report(result, console)
    results.write("soak", result, out=args.out, variant=args.variant or ("tiny" if args.tiny else None),
                  device=args.device)
    return 1 if total["errors"] or any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark traffic: when requests are sent, and a driver that sends them over gRPC streams.

``uniform``  closed loop: C requests in flight; each one that finishes is replaced by the next.
``trace``    closed loop whose C follows a trace over time (a JSON file: segments of seconds and
             concurrency; specbatch/traces/varying_1_32.json is the shipped one).
``poisson``  open loop: arrivals at a rate (requests per second) with exponential gaps.

What is random (Poisson gaps, which prompt each request gets) comes from a seeded generator, so a
schedule is the same in every run and for every mode it is compared across.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

TRACES = Path(__file__).resolve().parents[2] / "traces"
DEFAULT_TRACE = TRACES / "varying_1_32.json"


@dataclass(frozen=True)
class Trace:
    name: str
    segments: tuple[tuple[float, int], ...]  # (seconds, concurrency), in order

    @property
    def duration(self) -> float:
        return sum(seconds for seconds, _ in self.segments)

    @property
    def peak(self) -> int:
        return max(c for _, c in self.segments)

    def concurrency_at(self, t: float) -> int:
        """The concurrency in force at ``t`` seconds from the start (0 after the end)."""
        end = 0.0
        for seconds, concurrency in self.segments:
            end += seconds
            if t < end:
                return concurrency
        return 0

    def closed_loop_latency(self, tokens_per_s: dict[int, float], tokens_per_request: int) -> float:
        """The mean latency a closed loop over this trace sees at these steady throughputs (output
        tokens/s at each of its concurrencies). In a segment of T seconds at concurrency C, requests
        finish at tokens_per_s[C] / tokens_per_request a second and each takes C over that rate
        (Little's law), so every segment adds C·T request-seconds whatever the speed: the mean
        latency is Σ C·T over the requests finished, and a faster mode lowers it only as far as it
        finishes more requests. (Segment edges and the last requests' drain are left out.)"""
        finished = sum(seconds * tokens_per_s[c] / tokens_per_request for seconds, c in self.segments)
        return sum(seconds * c for seconds, c in self.segments) / finished

    def scaled(self, speed: float) -> "Trace":
        """The same shape, ``speed`` times faster."""
        return Trace(self.name, tuple((seconds / speed, c) for seconds, c in self.segments))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        data = json.loads(Path(path).read_text())
        segments = tuple((float(s["seconds"]), int(s["concurrency"])) for s in data["segments"])
        if not segments or any(seconds <= 0 or c < 1 for seconds, c in segments):
            raise ValueError(f"{path}: every segment needs seconds > 0 and concurrency >= 1")
        return cls(data.get("name", Path(path).stem), segments)


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``count`` Poisson arrivals at ``rate`` per second."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def prompt_order(count: int, prompts: int, seed: int) -> list[int]:
    """Which prompt the i-th request sends: a seeded shuffle, repeated as often as needed."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < count:
        block = list(range(prompts))
        rng.shuffle(block)
        order += block
    return order[:count]


@dataclass
class Record:
    """One request as its client saw it (seconds on the client's monotonic clock)."""

    index: int
    sent: float
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def latency(self) -> float:
        return self.finished - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a single token)."""
        return (self.finished - self.first_token) / (self.tokens - 1) if self.tokens > 1 else None


def stream(stub, index: int, request, timeout: float | None = None) -> Record:
    """Send one request as a server stream and time it."""
    record = Record(index, time.monotonic())
    try:
        for response in stub.Generate(request, timeout=timeout):
            if response.token_ids and record.first_token is None:
                record.first_token = time.monotonic()
            record.tokens += len(response.token_ids)
            if response.finish_reason:
                s = response.stats
                record.proposed, record.accepted, record.steps = (s.draft_tokens_proposed, s.draft_tokens_accepted,
                                                                  s.steps)
        record.finished = time.monotonic()
    except grpc.RpcError as error:
        record.error = error.code().name
    return record


def run_closed_loop(send, concurrency_at, count: int | None = None, duration: float | None = None,
                    poll: float = 0.02) -> list[Record]:
    """Keep ``concurrency_at(t)`` requests in flight until ``count`` were sent or ``duration``
    passed, then wait for the last ones. ``send(i)`` runs request i and returns its Record."""
    lock = threading.Condition()
    in_flight = 0
    jobs = []
    start = time.monotonic()

    def finished(_):
        nonlocal in_flight
        with lock:
            in_flight -= 1
            lock.notify()

    def elapsed() -> float:
        return time.monotonic() - start

    def over() -> bool:
        return duration is not None and elapsed() >= duration

    pool = futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="client")
    try:
        while count is None or len(jobs) < count:
            with lock:
                while not over() and in_flight >= concurrency_at(elapsed()):
                    lock.wait(timeout=poll)  # woken by a finish, or by the trace moving on
                if over():
                    break
                in_flight += 1
            job = pool.submit(send, len(jobs))
            job.add_done_callback(finished)
            jobs.append(job)
        return [job.result() for job in jobs]
    finally:
        pool.shutdown(wait=True)


def run_open_loop(send, arrivals: list[float]) -> list[Record]:
    """Send request i at ``arrivals[i]`` seconds from the start, whatever is still in flight."""
    pool = futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="client")
    jobs = []
    start = time.monotonic()
    try:
        for i, at in enumerate(arrivals):
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            jobs.append(pool.submit(send, i))
        return [job.result() for job in jobs]
    finally:
        pool.shutdown(wait=True)

"""The coordinator's Prometheus metrics: load, the speculation itself, request latencies and
outcomes, step timing, and the health of the replicas it talks to (docs/operations.md).

Latency buckets follow vLLM's so that dashboards made for vLLM read these too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specbatch.protocol.speculation import MAX_K
from specbatch.rpc.metrics import BATCH_BUCKETS, STEP_BUCKETS, new_registry

from .stats import StepStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)
K_BUCKETS = tuple(range(MAX_K + 1))  # one bucket per k: the histogram is a plain count by k


class CoordinatorMetrics:
    """What the coordinator exports: load, the speculation itself, request latencies and outcomes,
    step timing, and the health of the replicas it talks to.

    Methods take plain numbers; the scheduler calls ``observe_step`` once per decode step,
    ``observe_finished``/``observe_failed`` once per request that ends, and ``observe_rejected``
    for one refused at admission (so a refused request is counted once, never also as failed).
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else new_registry()
        r = self.registry

        # ---- load (read when scraped, from the scheduler: see track_load) ----
        self.running = Gauge("specbatch_num_requests_running", "Requests holding a batch slot: decoding, or their "
                             "prompts being prefilled.", registry=r)
        self.waiting = Gauge("specbatch_num_requests_waiting",
                             "Requests admitted and waiting for a batch slot (the coordinator HPA's metric).",
                             registry=r)
        self.occupancy = Gauge("specbatch_batch_occupancy", "Running requests / the maximum batch size, 0..1.",
                               registry=r)

        # ---- speculation ----
        self.batch_size = Histogram("specbatch_batch_size", "Sequences in a decode step.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.k = Histogram("specbatch_spec_decode_k", "k (draft tokens asked for) per sequence per step; 0 is a "
                           "target-only step for that sequence.", buckets=K_BUCKETS, registry=r)
        self.num_drafts = Counter("specbatch_spec_decode_num_drafts",
                                  "Drafts proposed and verified (one per sequence per step with k > 0).", registry=r)
        self.num_draft_tokens = Counter("specbatch_spec_decode_num_draft_tokens", "Draft tokens verified.",
                                        registry=r)
        self.num_accepted_tokens = Counter("specbatch_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target.", registry=r)
        self.accepted_per_pos = Counter("specbatch_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0-based).", ["position"],
                                        registry=r)
        # vLLM divides accepted_per_pos by num_drafts; that mixes in drafts that never reached the
        # position (a shorter k, or an earlier rejection). Counting the drafts that reached each
        # position gives the conditional acceptance, which is what a k policy needs.
        self.reached_per_pos = Counter("specbatch_spec_decode_num_draft_tokens_per_pos",
                                       "Drafts that reached each draft position (drafted that far with every earlier "
                                       "position accepted); acceptance at i = accepted_per_pos[i] / this[i].",
                                       ["position"], registry=r)
        self.leaf_chances = Counter("specbatch_spec_decode_num_leaf_chances",
                                    "First drafts rejected with leaves verified beside them (--leaves).", registry=r)
        self.leaf_hits = Counter("specbatch_spec_decode_num_leaf_hits",
                                 "Of those, the ones where the target's token was a leaf and the step kept it.",
                                 registry=r)
        self.lookup_draft_tokens = Counter("specbatch_spec_decode_num_lookup_draft_tokens",
                                           "Tokens drafted by prompt lookup (--prompt-lookup), no draft call made.",
                                           registry=r)
        self.lookup_accepted_tokens = Counter("specbatch_spec_decode_num_lookup_accepted_tokens",
                                              "Of those, the ones the target kept.", registry=r)
        self.shared_lookup_draft_tokens = Counter(
            "specbatch_spec_decode_num_shared_lookup_draft_tokens",
            "Of the lookup's draft tokens, those found in other requests' texts (--shared-lookup).", registry=r)
        self.shared_lookup_accepted_tokens = Counter("specbatch_spec_decode_num_shared_lookup_accepted_tokens",
                                                     "Of those, the ones the target kept.", registry=r)

        # ---- requests ----
        self.ttft = Histogram("specbatch_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specbatch_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("specbatch_e2e_request_latency_seconds", "Arrival to the request's end.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("specbatch_request_queue_time_seconds", "Arrival to joining the running batch.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.success = Counter("specbatch_request_success", "Requests that finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("specbatch_request_failure", "Admitted requests that ended with an error status.",
                               ["code"], registry=r)
        self.rejected = Counter("specbatch_requests_rejected", "Requests refused at admission, by status code.",
                                ["code"], registry=r)
        self.prompt_tokens = Counter("specbatch_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specbatch_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)

        # ---- steps and replicas ----
        self.step_seconds = Histogram("specbatch_step_seconds",
                                      "Decode step time by phase: draft (Propose calls), target (Verify calls), "
                                      "coordinator (the rest of the step).", ["phase"], buckets=STEP_BUCKETS,
                                      registry=r)
        self.replica_up = Gauge("specbatch_replica_up", "1 while the coordinator counts a replica healthy, else 0.",
                                ["service", "address"], registry=r)
        self.failovers = Counter("specbatch_replica_failovers", "Sequences moved off a failed replica.", ["service"],
                                 registry=r)
        self.draft_fallback = Counter("specbatch_draft_fallback_steps",
                                      "Steps run target-only because no draft replica was healthy.", registry=r)
        self.policy = Info("specbatch_k_policy", "The k policy in force.", registry=r)
        self.replica_k = Gauge("specbatch_replica_k", "The k the policy chose at a target replica's last step, for "
                               "its share of the batch (learn prices each replica's steps on their own).",
                               ["address"], registry=r)

    def track_load(self, load_fn, max_batch_size: int) -> None:
        """Read the load from ``load_fn() -> (running, waiting)`` whenever /metrics is scraped.

        Read at scrape time rather than pushed on every change, so the gauges are never stale and
        the scheduler does nothing per request for them. ``load_fn`` must be cheap and must not
        block on the step loop (the scheduler's ``load`` takes two ``len``s)."""
        self.running.set_function(lambda: load_fn()[0])
        self.waiting.set_function(lambda: load_fn()[1])
        self.occupancy.set_function(lambda: load_fn()[0] / max_batch_size if max_batch_size else 0.0)

    def observe_step(self, step: StepStats) -> None:
        """One decode step, as the scheduler recorded it (coordinator.stats.StepStats): the k of
        each sequence that stepped (0 where it ran target-only), (drafted, accepted) of each that
        drafted, and wall seconds of the step's Propose calls, its Verify calls and the whole
        step; the coordinator's own share is the rest."""
        self.batch_size.observe(step.batch_size)
        for k in step.ks:
            self.k.observe(k)
        self.num_drafts.inc(len(step.outcomes))
        self.num_draft_tokens.inc(step.draft_tokens)
        self.num_accepted_tokens.inc(step.accepted_tokens)
        for i, (n_reached, n_accepted) in enumerate(zip(step.reached_by_position, step.accepted_by_position)):
            if n_reached:  # no series for positions never drafted: k=3 shows three, not sixteen
                self.reached_per_pos.labels(position=str(i)).inc(n_reached)
                self.accepted_per_pos.labels(position=str(i)).inc(n_accepted)
        self.leaf_chances.inc(step.leaf_chances)
        self.leaf_hits.inc(step.leaf_hits)
        self.lookup_draft_tokens.inc(step.lookup_draft_tokens)
        self.lookup_accepted_tokens.inc(step.lookup_accepted_tokens)
        self.shared_lookup_draft_tokens.inc(step.shared_lookup_draft_tokens)
        self.shared_lookup_accepted_tokens.inc(step.shared_lookup_accepted_tokens)
        self.step_seconds.labels(phase="draft").observe(step.draft_seconds)
        self.step_seconds.labels(phase="target").observe(step.target_seconds)
        # Clamped: the phases are timed separately, and rounding must not make a negative sample.
        self.step_seconds.labels(phase="coordinator").observe(
            max(0.0, step.step_seconds - step.draft_seconds - step.target_seconds))

    def observe_finished(self, finished_reason: str, queue_seconds: float, first_token_seconds: float | None,
                         total_seconds: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A request that ended normally (stop, length, eos …; a cancelled stream too).

        All times are from the request's arrival. ``first_token_seconds`` is None when no token was
        generated; time per output token is then undefined and, as with one token, not observed."""
        self.success.labels(finished_reason=finished_reason).inc()
        self.queue_time.observe(queue_seconds)
        self.e2e.observe(total_seconds)
        if first_token_seconds is not None:
            self.ttft.observe(first_token_seconds)
            if generated_tokens > 1:
                self.tpot.observe((total_seconds - first_token_seconds) / (generated_tokens - 1))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)

    def observe_failed(self, code: str) -> None:
        """An admitted request that ended with an error status (``code``: a grpc.StatusCode name)."""
        self.failure.labels(code=code).inc()

    def observe_rejected(self, code: str) -> None:
        """A request refused at admission: INVALID_ARGUMENT, RESOURCE_EXHAUSTED (queue full) …"""
        self.rejected.labels(code=code).inc()

    def set_replica_k(self, chosen: dict) -> None:
        """{target replica: k} of the last step (replica None: requests not placed: skipped)."""
        for replica, k in chosen.items():
            if replica is not None:
                self.replica_k.labels(address=replica.address).set(k)

    def set_replica_up(self, service: str, address: str, up: bool) -> None:
        self.replica_up.labels(service=service, address=address).set(1 if up else 0)

    def forget_replica(self, service: str, address: str) -> None:
        """Drop a replica's series once it is gone for good (left DNS), so it does not read 0 forever."""
        try:
            self.replica_up.remove(service, address)
        except KeyError:
            pass
        if service == "target":
            try:
                self.replica_k.remove(address)
            except KeyError:
                pass

    def count_failover(self, service: str, n: int) -> None:
        """``n`` sequences moved off a failed ``service`` ("draft" or "target") replica."""
        if n:
            self.failovers.labels(service=service).inc(n)

    def count_draft_fallback(self) -> None:
        self.draft_fallback.inc()

    def set_policy(self, description: str) -> None:
        """The k policy in force, as text (e.g. "fixed:3", "goodput (profile …)")."""
        self.policy.info({"policy": description})

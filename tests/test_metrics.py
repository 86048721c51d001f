"""coordinator/metrics.py, specbatch/service/metrics.py, specbatch/rpc/metrics.py and specbatch/rpc/logs.py:
the coordinator's metric arithmetic, a real target service's /metrics over HTTP (engine gauges,
per-method counts with status codes), the services' metric and log flags, and JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import urllib.request

import grpc
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coordinator import metrics as coordinator_metrics
from coordinator.metrics import CoordinatorMetrics
from coordinator.stats import StepStats
from specbatch.config.options import parser_for
from specbatch.engine.engine import Engine
from specbatch.rpc import metrics as metrics_module
from specbatch.rpc.logs import configure_logging
from specbatch.rpc.metrics import serve_metrics, start_metrics_server
from specbatch.rpc.server import Server
from specbatch.service.metrics import ServiceMetrics
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc
from target_service.servicer import TargetServicer


def value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


# ---- the coordinator's metrics --------------------------------------------------------------------

def test_step_counts_drafts_per_position():
    m = CoordinatorMetrics(CollectorRegistry())
    # Three sequences: k 3 (1 accepted), k 2 (both accepted), k 0 (target-only: no draft).
    m.observe_step(StepStats(3, [3, 2, 0], [(3, 1), (2, 2)], draft_seconds=0.010, target_seconds=0.030,
                             step_seconds=0.045))
    r = m.registry
    assert value(r, "specbatch_spec_decode_num_drafts_total") == 2
    assert value(r, "specbatch_spec_decode_num_draft_tokens_total") == 5
    assert value(r, "specbatch_spec_decode_num_accepted_tokens_total") == 3
    # (3, 1) reaches positions 0 and 1 (rejected at 1, so never 2); (2, 2) reaches 0 and 1.
    reached = [value(r, "specbatch_spec_decode_num_draft_tokens_per_pos_total", position=str(i)) for i in range(3)]
    accepted = [value(r, "specbatch_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                for i in range(3)]
    assert reached == [2, 2, None] and accepted == [2, 1, None]
    # k is a histogram with one bucket per value.
    assert value(r, "specbatch_spec_decode_k_bucket", le="0.0") == 1
    assert value(r, "specbatch_spec_decode_k_bucket", le="2.0") == 2
    assert value(r, "specbatch_spec_decode_k_bucket", le="3.0") == 3
    assert value(r, "specbatch_spec_decode_k_sum") == 5
    assert value(r, "specbatch_batch_size_sum") == 3 and value(r, "specbatch_batch_size_count") == 1
    assert value(r, "specbatch_step_seconds_sum", phase="draft") == pytest.approx(0.010)
    assert value(r, "specbatch_step_seconds_sum", phase="target") == pytest.approx(0.030)
    assert value(r, "specbatch_step_seconds_sum", phase="coordinator") == pytest.approx(0.005)

    # A second step adds up; a draft of 0 tokens counts as no draft.
    m.observe_step(StepStats(1, [4], [(4, 4), (0, 0)], 0.0, 0.0, 0.0))
    assert value(r, "specbatch_spec_decode_num_drafts_total") == 3
    assert value(r, "specbatch_spec_decode_num_draft_tokens_per_pos_total", position="3") == 1
    assert value(r, "specbatch_spec_decode_num_accepted_tokens_per_pos_total", position="3") == 1
    assert value(r, "specbatch_spec_decode_num_draft_tokens_per_pos_total", position="0") == 3
    assert value(r, "specbatch_step_seconds_count", phase="coordinator") == 2
    assert value(r, "specbatch_spec_decode_num_leaf_chances_total") == 0

    # Leaves: two first drafts rejected with leaves beside them, one leaf kept.
    m.observe_step(StepStats(2, [2, 2], [(2, 0), (2, 0)], 0.0, 0.0, 0.0, leaf_chances=2, leaf_hits=1))
    assert value(r, "specbatch_spec_decode_num_leaf_chances_total") == 2
    assert value(r, "specbatch_spec_decode_num_leaf_hits_total") == 1


def test_max_k_agrees_with_the_draft_service():
    from draft_service.proposer import MAX_K

    assert coordinator_metrics.MAX_K == MAX_K
    assert coordinator_metrics.K_BUCKETS == tuple(range(MAX_K + 1))


def test_finished_request_latencies():
    m = CoordinatorMetrics(CollectorRegistry())
    r = m.registry
    # Queued 0.1 s, first token at 0.5 s, 5 tokens by 2.5 s: 4 more tokens in 2.0 s.
    m.observe_finished("stop", queue_seconds=0.1, first_token_seconds=0.5, total_seconds=2.5, prompt_tokens=7,
                       generated_tokens=5)
    assert value(r, "specbatch_time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert value(r, "specbatch_time_per_output_token_seconds_count") == 1
    assert value(r, "specbatch_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(r, "specbatch_e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    assert value(r, "specbatch_request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert value(r, "specbatch_request_success_total", finished_reason="stop") == 1
    # One token: a first-token time but no time per output token; no token: neither.
    m.observe_finished("length", 0.0, 0.2, 0.2, 3, 1)
    m.observe_finished("cancelled", 0.3, None, 0.3, 4, 0)
    assert value(r, "specbatch_time_per_output_token_seconds_count") == 1
    assert value(r, "specbatch_time_to_first_token_seconds_count") == 2
    assert value(r, "specbatch_e2e_request_latency_seconds_count") == 3
    assert value(r, "specbatch_prompt_tokens_total") == 14
    assert value(r, "specbatch_generation_tokens_total") == 6
    assert value(r, "specbatch_request_success_total", finished_reason="length") == 1
    assert value(r, "specbatch_request_success_total", finished_reason="cancelled") == 1


def test_failures_rejections_replicas_policy():
    m = CoordinatorMetrics(CollectorRegistry())
    r = m.registry
    m.observe_rejected("INVALID_ARGUMENT")
    m.observe_rejected("INVALID_ARGUMENT")
    m.observe_rejected("RESOURCE_EXHAUSTED")
    m.observe_failed("UNAVAILABLE")
    assert value(r, "specbatch_requests_rejected_total", code="INVALID_ARGUMENT") == 2
    assert value(r, "specbatch_requests_rejected_total", code="RESOURCE_EXHAUSTED") == 1
    assert value(r, "specbatch_request_failure_total", code="UNAVAILABLE") == 1
    assert value(r, "specbatch_request_failure_total", code="INVALID_ARGUMENT") is None

    m.set_replica_up("target", "10.0.0.1:50052", True)
    m.set_replica_up("target", "10.0.0.2:50052", True)
    m.set_replica_up("target", "10.0.0.2:50052", False)
    assert value(r, "specbatch_replica_up", service="target", address="10.0.0.1:50052") == 1
    assert value(r, "specbatch_replica_up", service="target", address="10.0.0.2:50052") == 0
    m.forget_replica("target", "10.0.0.2:50052")
    m.forget_replica("target", "10.0.0.2:50052")  # twice: no error
    assert value(r, "specbatch_replica_up", service="target", address="10.0.0.2:50052") is None
    m.count_failover("draft", 3)
    m.count_failover("draft", 0)
    m.count_draft_fallback()
    assert value(r, "specbatch_replica_failovers_total", service="draft") == 3
    assert value(r, "specbatch_draft_fallback_steps_total") == 1
    m.set_policy("fixed:3")
    assert value(r, "specbatch_k_policy_info", policy="fixed:3") == 1


def test_load_is_read_at_scrape_time_under_the_hpa_names():
    m = CoordinatorMetrics(CollectorRegistry())
    load = [(2, 3)]
    m.track_load(lambda: load[0], max_batch_size=8)
    text = generate_latest(m.registry).decode()
    assert "specbatch_num_requests_waiting 3.0" in text  # the coordinator HPA's metric
    assert "specbatch_num_requests_running 2.0" in text
    assert "specbatch_batch_occupancy 0.25" in text
    load[0] = (8, 0)
    text = generate_latest(m.registry).decode()
    assert "specbatch_num_requests_waiting 0.0" in text and "specbatch_batch_occupancy 1.0" in text


# ---- a real target service -----------------------------------------------------------------------

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


@pytest.fixture
def served_target(target_model):
    engine = Engine(target_model, max_sequences=4)
    metrics = ServiceMetrics("target", engine, CollectorRegistry())
    server = Server("127.0.0.1:0", max_workers=4, interceptors=[metrics.interceptor()])
    TargetServicer.serve_on(server, engine, "tiny-target", metrics=metrics)
    server.start()
    http = start_metrics_server(metrics.registry, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield mpb_grpc.TargetStub(channel), http.port, metrics
    finally:
        channel.close()
        http.stop()
        server.stop(grace=1)


def test_target_service_metrics_over_http(served_target):
    stub, port, metrics = served_target
    text = scrape(port)
    assert "specbatch_num_sequences 0.0" in text and "specbatch_max_sequences 4.0" in text

    stub.Prefill(mpb.PrefillRequest(sequences=[mpb.SequenceInput(seq_id="a", tokens=[1, 5, 6, 7])]), timeout=10)
    text = scrape(port)
    assert 'specbatch_service_requests_total{code="OK",method="Prefill"} 1.0' in text
    assert "specbatch_num_sequences 1.0" in text
    assert "specbatch_cached_tokens 4.0" in text
    assert "specbatch_batch_occupancy 0.25" in text  # the target HPA's metric: 1 of 4
    assert 'specbatch_service_batch_size_count{method="Prefill"} 1.0' in text
    assert 'specbatch_service_compute_seconds_count{method="Prefill"} 1.0' in text
    assert 'specbatch_service_request_seconds_count{method="Prefill"} 1.0' in text
    assert 'specbatch_service_info{service="target"} 1.0' in text

    # Refused calls are counted with the status they ended with, and record no engine call.
    with pytest.raises(grpc.RpcError) as refused:
        stub.Verify(mpb.VerifyRequest(items=[mpb.VerifyItem(sequence=mpb.SequenceInput(seq_id="ghost", tokens=[1]))]),
                    timeout=10)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as refused:
        stub.Prefill(mpb.PrefillRequest(sequences=[mpb.SequenceInput(seq_id="b", tokens=[1, 10_000])]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Verify(mpb.VerifyRequest(items=[mpb.VerifyItem(sequence=mpb.SequenceInput(seq_id="a", keep_len=4, tokens=[8]),
                                                        draft_tokens=[9, 10])]), timeout=10)
    stub.Release(mpb.ReleaseRequest(seq_ids=["a"]), timeout=10)
    text = scrape(port)
    assert 'specbatch_service_requests_total{code="NOT_FOUND",method="Verify"} 1.0' in text
    assert 'specbatch_service_requests_total{code="INVALID_ARGUMENT",method="Prefill"} 1.0' in text
    assert 'specbatch_service_requests_total{code="OK",method="Verify"} 1.0' in text
    assert 'specbatch_service_requests_total{code="OK",method="Release"} 1.0' in text
    assert 'specbatch_service_requests_total{code="OK",method="Prefill"} 1.0' in text
    assert 'specbatch_service_batch_size_count{method="Prefill"} 1.0' in text  # the refused one is not in it
    assert 'specbatch_service_batch_size_count{method="Verify"} 1.0' in text
    assert "specbatch_num_sequences 0.0" in text and "specbatch_batch_occupancy 0.0" in text


def test_services_and_coordinator_share_a_process_not_a_registry(target_model):
    engine = Engine(target_model, max_sequences=2)
    target, draft, coordinator = ServiceMetrics("target", engine), ServiceMetrics("draft", engine), CoordinatorMetrics()
    assert len({id(target.registry), id(draft.registry), id(coordinator.registry)}) == 3
    assert prometheus_client.REGISTRY.get_sample_value("specbatch_num_sequences") is None
    assert draft.registry.get_sample_value("specbatch_max_sequences") == 2
    # Registries made inside carry the process's own metrics too (from /proc: Linux only).
    if sys.platform.startswith("linux"):
        assert "process_resident_memory_bytes" in generate_latest(coordinator.registry).decode()
        assert "process_resident_memory_bytes" in generate_latest(target.registry).decode()


# ---- flags ----------------------------------------------------------------------------------------

def test_model_service_flags():
    args = parser_for("draft").parse_args(
        ["--metrics-port=9090", "--metrics-host=0.0.0.0", "--log-format=json"])
    assert (args.metrics_port, args.metrics_host, args.log_format) == (9090, "0.0.0.0", "json")
    args = parser_for("target").parse_args([])
    assert (args.metrics_port, args.metrics_host, args.log_format) == (None, "127.0.0.1", "text")
    with pytest.raises(SystemExit):
        parser_for("target").parse_args(["--log-format=xml"])


def test_metrics_port_taken(monkeypatch, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Given on the command line: it must work, or the service stops.
        with pytest.raises(SystemExit, match=str(port)):
            serve_metrics(CollectorRegistry(), "target", "127.0.0.1", port)
        # The default (another stack on this host holds it): serve on, without metrics, and say so.
        monkeypatch.setitem(metrics_module.DEFAULT_METRICS_PORTS, "target", port)
        with caplog.at_level(logging.WARNING):
            assert serve_metrics(CollectorRegistry(), "target", "127.0.0.1", None) is None
        assert "--metrics-port" in caplog.text
    assert serve_metrics(CollectorRegistry(), "target", "127.0.0.1", 0) is None  # 0: off
    monkeypatch.setitem(metrics_module.DEFAULT_METRICS_PORTS, "target", port)  # free again now
    server = serve_metrics(CollectorRegistry(), "target", "127.0.0.1", None)
    try:
        assert server.port == port
    finally:
        server.stop()


# ---- logs -----------------------------------------------------------------------------------------

def test_json_log_lines():
    stream = io.StringIO()
    configure_logging("INFO", "json", stream)
    log = logging.getLogger("specbatch.test")
    log.info("admitted %d tokens", 12, extra={"request_id": "r-1", "seq_id": "r-1/0", "code": "OK"})
    log.debug("not at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("step failed", extra={"replica": "10.0.0.1:50052", "service": "target"})
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["message"] == "admitted 12 tokens" and first["level"] == "INFO"
    assert first["logger"] == "specbatch.test" and first["time"].startswith("20")
    assert (first["request_id"], first["seq_id"], first["code"]) == ("r-1", "r-1/0", "OK")
    assert "replica" not in first
    assert second["level"] == "ERROR" and second["replica"] == "10.0.0.1:50052" and second["service"] == "target"
    assert "ValueError: boom" in second["exc_info"]


def test_text_log_lines_show_request_fields():
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    log = logging.getLogger("specbatch.test")
    log.info("plain")
    log.warning("slow step", extra={"request_id": "r-2", "seq_id": "r-2/0"})
    plain, slow = stream.getvalue().splitlines()
    assert plain.endswith("INFO specbatch.test: plain")
    assert slow.endswith("WARNING specbatch.test: slow step [request_id=r-2 seq_id=r-2/0]")
    with pytest.raises(ValueError):
        configure_logging("INFO", "xml", stream)


def test_captured_steps_export_their_replayed_and_eager_calls(target_model):
    """A GPU step that falls back to eager costs several times its captured time, silently: the
    services export both counts (and log each reason once)."""
    from specbatch.engine.batch import SequenceInput
    from specbatch.service.metrics import ServiceMetrics
    from target_service.verifier import VerifyItem, verify

    engine = Engine(target_model, max_sequences=4, max_context=64, captured_steps="static")
    registry = ServiceMetrics("target", engine).registry
    engine.prefill([SequenceInput("a", 0, list(range(5, 25)))])  # 20 tokens: past every bucket
    verify(engine, [VerifyItem(SequenceInput("a", 20, [7]), [8, 9])])
    assert registry.get_sample_value("specbatch_captured_calls", {"path": "eager"}) == 1
    assert registry.get_sample_value("specbatch_captured_calls", {"path": "replayed"}) == 1
    assert ServiceMetrics("target", Engine(target_model, max_sequences=2)).registry.get_sample_value(
        "specbatch_captured_calls", {"path": "eager"}) is None  # no captured steps, no such metric

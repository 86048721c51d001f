"""--emulate-acceptance: the target keeps drafts by seeded draws at given rates (for timing
random-weight pairs), and says so in CacheStats, Info and its metrics; off by default."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tiny import VOCAB

import specbatch
from coordinator.app import build_coordinator
from draft_service.servicer import DraftServicer
from specbatch.config.options import parser_for
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.protocol.emulation import parse_rates, rate_at
from specbatch.rpc.server import Server
from specbatch.service.metrics import ServiceMetrics
from specbatch.stack.in_process import serve_engine
from specbatch.v1 import generation_pb2 as gpb
from specbatch.v1 import generation_pb2_grpc as gpb_grpc
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc
from target_service.servicer import TargetServicer
from target_service.verifier import VerifyItem, verify


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(count)]


def drafts(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(k)]


def started(engine: Engine, prompts: list[list[int]]) -> dict[str, tuple[int, int]]:
    """Each prompt prefilled as sequence s<i>: its cached length and the target's next token."""
    verdicts = verify(engine, [VerifyItem(SequenceInput(f"s{i}", 0, p)) for i, p in enumerate(prompts)], create=True)
    return {f"s{i}": (v.cached_len, v.next_token) for i, v in enumerate(verdicts)}


# ---- the verifier ---------------------------------------------------------------------------------

def test_drafts_are_kept_at_the_given_conditional_rates(target_model):
    rates, k, sequences, steps = (0.8, 0.6, 0.3), 4, 64, 32  # position 3 repeats 0.3
    engine = Engine(target_model)
    state = started(engine, prompts(sequences, seed=1))
    rng = random.Random(2)
    reached, kept = [0] * k, [0] * k
    for _ in range(steps):
        items = [VerifyItem(SequenceInput(seq, cached, [token]), drafts(rng, k)) for seq, (cached, token) in state.items()]
        for item, verdict in zip(items, verify(engine, items, emulated=rates)):
            for j in range(min(verdict.accepted + 1, k)):  # positions the row reached
                reached[j] += 1
                kept[j] += j < verdict.accepted
            # The cache keeps exactly the uncached token and the accepted drafts.
            assert verdict.cached_len == item.seq.keep_len + 1 + verdict.accepted == engine.length(item.seq.seq_id)
            state[item.seq.seq_id] = (verdict.cached_len, verdict.next_token)
    # Given n rows reached position j, those kept there are Binomial(n, rate): the rate's estimate
    # has standard error sqrt(r (1 - r) / n). z = 5.3 bounds a false failure by 1e-6 over the four
    # positions (Bonferroni); the seeds are fixed, so the outcome is the same every run anyway.
    z = 5.3
    for j in range(k):
        rate = rate_at(rates, j)
        assert reached[j] >= 50, reached  # enough draws for the bound to mean something
        tolerance = z * math.sqrt(rate * (1 - rate) / reached[j])
        assert abs(kept[j] / reached[j] - rate) <= tolerance, (j, kept[j], reached[j], rate, tolerance)


def test_a_row_keeps_the_same_alone_and_in_a_batch(target_model):
    ps = prompts(6, seed=3)
    together, alone = Engine(target_model), Engine(target_model)
    state = started(together, ps)
    for i, p in enumerate(ps):  # the same sequences, each prefilled in a call of its own
        verify(alone, [VerifyItem(SequenceInput(f"s{i}", 0, p))], create=True)
    rng = random.Random(4)
    for _ in range(6):
        items = [VerifyItem(SequenceInput(seq, cached, [token]), drafts(rng, rng.randrange(1, 6)))
                 for seq, (cached, token) in state.items()]
        batch = verify(together, items, emulated=(0.7, 0.5))
        one_by_one = [verify(alone, [item], emulated=(0.7, 0.5))[0] for item in items]
        assert [(v.accepted, v.next_token, v.cached_len) for v in batch] == \
            [(v.accepted, v.next_token, v.cached_len) for v in one_by_one]
        state = {item.seq.seq_id: (v.cached_len, v.next_token) for item, v in zip(items, batch)}
    assert any(v.accepted for v in batch) and not all(v.accepted == len(i.drafts) for i, v in zip(items, batch))


def test_rate_one_keeps_every_draft_and_zero_none(target_model):
    engine, reference = Engine(target_model), Engine(target_model)
    ps = prompts(4, seed=5)
    state = started(engine, ps)
    rng = random.Random(6)
    chains = {seq: drafts(rng, 3) for seq in state}
    items = [VerifyItem(SequenceInput(seq, cached, [token]), chains[seq]) for seq, (cached, token) in state.items()]
    all_kept = verify(engine, items, emulated=(1.0,))
    assert [v.accepted for v in all_kept] == [3] * 4
    for item, verdict, prompt in zip(items, all_kept, ps):
        assert verdict.cached_len == item.seq.keep_len + 1 + 3 == engine.length(item.seq.seq_id)
        # The next token is the target's own after the kept drafts: as a fresh engine computes it
        # over the same history, so the cache holds what it should.
        history = prompt + item.seq.tokens + item.drafts
        (expected,) = verify(reference, [VerifyItem(SequenceInput(item.seq.seq_id, 0, history))], create=True)
        assert verdict.next_token == expected.next_token
    # And it continues: a following step (verified for real) sees the same cache as the reference.
    items = [VerifyItem(SequenceInput(item.seq.seq_id, v.cached_len, [v.next_token]), [])
             for item, v in zip(items, all_kept)]
    follow = verify(engine, items)
    expected = verify(reference, [VerifyItem(SequenceInput(i.seq.seq_id, i.seq.keep_len, i.seq.tokens)) for i in items])
    assert [v.next_token for v in follow] == [v.next_token for v in expected]
    assert [v.cached_len for v in follow] == [v.cached_len for v in expected]

    # Rate 0 keeps none (and no leaf, whatever the leaves): the next token is the target's at the
    # first draft's position, as a plain decode step gives it.
    items = [VerifyItem(SequenceInput(i.seq.seq_id, v.cached_len, [v.next_token]), drafts(rng, 3),
                        leaves=[[t % (VOCAB - 1) + 1 for t in range(v.next_token, v.next_token + 2)]])
             for i, v in zip(items, follow)]
    items = [VerifyItem(i.seq, i.drafts, leaves=[[t for t in i.leaves[0] if t != i.drafts[0]]]) for i in items]
    none_kept = verify(engine, items, emulated=(0.0,))
    plain = verify(reference, [VerifyItem(i.seq) for i in items])
    assert [v.accepted for v in none_kept] == [0] * 4
    assert all(v.leaf is None for v in none_kept)
    assert [v.next_token for v in none_kept] == [v.next_token for v in plain]
    assert [engine.length(i.seq.seq_id) for i in items] == [i.seq.keep_len + 1 for i in items]


# ---- the services, the coordinator, the flag -----------------------------------------------------

def serve(target_model, draft_model, tokenizer, emulated=None):
    """A target (with metrics), a draft and a coordinator over them; ``emulated``: the target's rates."""
    target_engine = Engine(target_model, max_sequences=8)
    metrics = ServiceMetrics("target", target_engine, CollectorRegistry())
    target = Server("127.0.0.1:0", max_workers=4)
    TargetServicer.serve_on(target, target_engine, "tiny-target", metrics=metrics, emulated_acceptance=emulated)
    target.start()
    draft = serve_engine(Engine(draft_model, max_sequences=8), DraftServicer.serve_on, "draft")
    coordinator = build_coordinator(f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}", tokenizer,
                                    max_batch_size=4, max_new_tokens=64)
    return target, draft, coordinator, metrics


@pytest.mark.parametrize("emulated", [None, (0.8, 0.5)], ids=["off", "on"])
def test_reported_in_cache_stats_info_metrics_and_bench_results(target_model, draft_model, tokenizer, emulated,
                                                               tmp_path, capsys):
    from specbatch.commands import cli

    target, draft, coordinator, metrics = serve(target_model, draft_model, tokenizer, emulated)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            stats = mpb_grpc.TargetStub(channel).CacheStats(mpb.CacheStatsRequest(), timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = gpb_grpc.GenerationStub(channel)
            # Serving works under it: a request with drafts streams its tokens to the end.
            responses = list(stub.Generate(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 5, 6, 7]), max_new_tokens=24, k=3),
                                           timeout=60))
            info = stub.Info(gpb.InfoRequest(), timeout=10)
        expected = "0.8,0.5" if emulated else ""
        assert stats.emulated_acceptance == expected and info.emulated_acceptance == expected
        final = responses[-1]
        assert final.finish_reason and sum(len(r.token_ids) for r in responses) == final.stats.generated_tokens > 0
        value = metrics.registry.get_sample_value
        if emulated:
            assert value("specbatch_emulated_acceptance", {"position": "0"}) == 0.8
            assert value("specbatch_emulated_acceptance", {"position": "1"}) == 0.5
        else:
            assert value("specbatch_emulated_acceptance", {"position": "0"}) is None
        # specbatch bench records it in its results (read from Info), and prints it.
        out = tmp_path / "bench"
        assert cli.main(["bench", "--address", f"127.0.0.1:{coordinator.port}", "--fixed-k", "2", "--traffic",
                         "uniform", "--concurrency", "1", "--requests", "1", "--max-new-tokens", "4", "--prompts",
                         "chat", "--out", str(out)]) == 0
        assert json.loads((out / "results.json").read_text())["emulated_acceptance"] == (expected or None)
        assert ("acceptance EMULATED at 0.8,0.5" in capsys.readouterr().out) == bool(emulated)
    finally:
        coordinator.stop(grace=1)
        draft.stop(grace=1)
        target.stop(grace=1)


def test_a_hosted_draft_drafts_after_emulated_verdicts(target_model, draft_model, tokenizer):
    """Where the target hosts the draft (--with-draft, as ``specbatch up`` places it on a CPU), each
    Verify's emulated verdict is followed by the next step's proposal, as with real verdicts: the
    request streams to its end, keeping drafts at the given rates."""
    target_engine = Engine(target_model, max_sequences=8)
    draft_engine = Engine(draft_model, max_sequences=8, model_thread=target_engine.model_thread,
                          lock=target_engine.lock)
    target = Server("127.0.0.1:0", max_workers=4)
    TargetServicer.serve_on(target, target_engine, "tiny-target", emulated_acceptance=(0.9, 0.8),
                            draft=draft_engine, draft_name="tiny-draft")
    target.start()
    address = f"127.0.0.1:{target.port}"
    coordinator = build_coordinator(address, address, tokenizer, max_batch_size=4, max_new_tokens=64)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            responses = list(gpb_grpc.GenerationStub(channel).Generate(
                gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 5, 6, 7]), max_new_tokens=32, k=3,
                                    ignore_eos=True), timeout=60))
        stats = responses[-1].stats
        assert sum(len(r.token_ids) for r in responses) == stats.generated_tokens == 32
        assert stats.draft_tokens_accepted > stats.steps  # more than one kept a step: 0.9, 0.8, 0.8
    finally:
        coordinator.stop(grace=1)
        target.stop(grace=1)


def test_the_warning_at_start(target_model, caplog):
    with caplog.at_level("WARNING"):
        TargetServicer(Engine(target_model), "tiny-target", emulated_acceptance=(0.7,))
    assert any("EMULATED ACCEPTANCE" in r.message and "0.7" in r.message for r in caplog.records)


def test_the_flag(tmp_path):
    from specbatch.config.options import pass_on

    target = parser_for("target")
    assert target.parse_args([]).emulate_acceptance is None  # off by default
    assert parse_rates(target.parse_args(["--emulate-acceptance", "0.8,0.7,0.6"]).emulate_acceptance) == (0.8, 0.7, 0.6)
    assert parse_rates("0.7") == (0.7,)
    shipped = Path(specbatch.__file__).parent / "profiles" / "embedded-cpu.json"
    assert parse_rates(str(shipped)) == tuple(json.loads(shipped.read_text())["acceptance_by_position"])
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text('{"format": "specbatch-profile"}')
    for bad in ("1.2", "-0.1", "0.8,,0.5", "nan", "0.5,abc", "", "no-such-file.json", str(bad_profile)):
        with pytest.raises(SystemExit):
            target.parse_args(["--emulate-acceptance", bad])
    # specbatch up (and bench and profile, which take its options) hands it to the target only.
    up = parser_for("up").parse_args(["--emulate-acceptance", "0.9,0.6"])
    values = vars(up)
    flags = pass_on(values, "target")
    assert flags[flags.index("--emulate-acceptance") + 1] == "0.9,0.6"
    assert "--emulate-acceptance" not in pass_on(values, "draft") + pass_on(values, "coordinator")
    with pytest.raises(SystemExit):
        parser_for("draft").parse_args(["--emulate-acceptance", "0.5"])


def test_profile_records_it_and_measures_its_rates(target_model, draft_model, tokenizer, tmp_path):
    from specbatch.commands import cli
    from specbatch.protocol.profile import load_profile

    target, draft, coordinator, _ = serve(target_model, draft_model, tokenizer, (1.0,))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "profile.json"
    try:
        assert cli.main(["profile", "--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}",
                         "--tokenizer", str(tmp_path / "tokenizer"), "--batch-sizes", "1,2", "--max-k", "2",
                         "--steps", "2", "--warmup-steps", "1", "--max-prompt-tokens", "64", "--out", str(out),
                         "--hardware", "a test"]) == 0
    finally:
        coordinator.stop(grace=1)
        draft.stop(grace=1)
        target.stop(grace=1)
    profile = load_profile(out)
    assert profile.workload["emulated_acceptance"] == "1"
    assert profile.acceptance_by_position == (1.0, 1.0)  # every draft kept, as the rate says

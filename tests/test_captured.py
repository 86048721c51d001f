"""Captured steps (specbatch.engine.captured): buckets, the fallbacks, the padded static path against the
eager one token for token, and the pool that never moves. CUDA graphs themselves only where a
GPU is."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import VOCAB, greedy_reference, tiny_opt

from draft_service.proposer import ProposeItem, proposals, propose
from specbatch.config.speculation import SpeculationConfig
from specbatch.engine.batch import SequenceInput
from specbatch.engine.buckets import Buckets
from specbatch.engine.captured import CapturedForward
from specbatch.engine.engine import Engine
from specbatch.engine.kv_pool import tree_mask, write_columns_and_mask
from specbatch.protocol.errors import CapacityExceeded
from target_service.verifier import VerifyItem, verify


def prompts(lengths, seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, VOCAB) for _ in range(n - 1)] for n in lengths]


# ---- buckets and fallbacks ---------------------------------------------------------------------


def test_bucket_for_picks_the_smallest_fitting_bucket():
    buckets = Buckets.for_pool(slots=12, context=257)
    assert buckets.batch == (1, 2, 4, 8, 12)
    assert buckets.width == (1, 2, 4, 8, 16, 17)
    assert buckets.context == (64, 128, 256)
    assert buckets.bucket_for(1, 1, 1) == (1, 1, 64)
    assert buckets.bucket_for(3, 5, 65) == (4, 8, 128)
    assert buckets.bucket_for(9, 17, 256) == (12, 17, 256)
    assert buckets.bucket_for(13, 1, 1) is None
    assert buckets.bucket_for(1, 18, 1) is None
    assert buckets.bucket_for(1, 1, 257) is None
    assert Buckets.for_pool(slots=4, context=100).context == (64, 99)
    assert buckets.all()[0] == (12, 17, 256) and buckets.all()[-1] == (1, 1, 64)


def counts(engine: Engine) -> tuple[int, int]:
    return engine.forward.replayed, engine.forward.eager


def test_calls_outside_the_static_path_run_eagerly_and_are_counted(target_model):
    engine = Engine(target_model, max_sequences=8, max_context=128, captured_steps="static")
    assert isinstance(engine.forward, CapturedForward) and engine.captured_steps == "static"
    ids = [f"s{i}" for i in range(3)]
    engine.prefill([SequenceInput(i, 0, p) for i, p in zip(ids, prompts([20, 5, 30], 0))])
    assert counts(engine) == (0, 1)  # 30 tokens a row: wider than every width bucket

    def step(which):
        verify(engine, [VerifyItem(SequenceInput(ids[i], engine.length(ids[i]), [7]), [8, 9]) for i in which])

    step([0, 1, 2])  # the whole batch, slot 0 on: replayed
    assert counts(engine) == (1, 1)
    step([0, 1])  # a prefix of the live slots: replayed (row 2 of the bucket is padding)
    assert counts(engine) == (2, 1)
    step([1, 2])  # contiguous, not from slot 0: spread over slots 0-2 (row 0 padding), replayed
    assert counts(engine) == (3, 1)
    step([2, 0])  # not contiguous: spread likewise (row 1 padding)
    assert counts(engine) == (4, 1)
    engine.prefill([SequenceInput(ids[0], engine.length(ids[0]), list(range(5, 23)))])  # 18 tokens
    assert counts(engine) == (4, 2)
    step([2])  # the last slot alone: spread, replayed
    assert counts(engine) == (5, 2)
    # The last slot alone, 18 tokens: wider than every bucket, so not spread (padding rows would
    # cost a wide call their tokens) but gathered, and eager.
    verify(engine, [VerifyItem(SequenceInput(ids[2], engine.length(ids[2]), list(range(5, 23))), [])])
    assert counts(engine) == (5, 3)
    assert engine.forward.eager_reasons == {"tokens past every bucket": 3}


def test_captured_modes_need_cuda_and_auto_is_off_on_cpu(target_model):
    assert Engine(target_model, max_sequences=2).captured_steps == "off"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Engine(target_model, max_sequences=2, captured_steps="on")
    with pytest.raises(ValueError, match="unknown mode"):
        Engine(target_model, max_sequences=2, captured_steps="sometimes")


# ---- the static path equals the eager one ------------------------------------------------------


def test_static_logits_and_hidden_states_match_eager(target_model):
    eager = Engine(target_model, max_sequences=8, max_context=200)
    static = Engine(target_model, max_sequences=8, max_context=200, captured_steps="static")
    ps = prompts([9, 40, 3, 70, 12], 1)
    for engine in (eager, static):
        engine.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(ps)])
    # Ragged: 1 to 6 new tokens a row; three of the five rows (a prefix of the slots), then all five.
    for which in ([0, 1, 2], [0, 1, 2, 3, 4]):
        out = []
        for engine in (eager, static):
            fed = [SequenceInput(f"s{i}", len(ps[i]) - (i % 3), ps[i][len(ps[i]) - (i % 3):] + [5 + i] * (i + 1))
                   for i in which]
            batch = engine.start(fed)
            out.append((batch.prefill(6), batch.last_hidden()))
            batch.commit([0] * len(which))
        assert static.forward.replayed == 1 + (which == [0, 1, 2, 3, 4])
        (eager_logits, eager_hidden), (static_logits, static_hidden) = out
        assert static_logits.shape == eager_logits.shape
        torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(static_hidden, eager_hidden, rtol=1e-4, atol=1e-4)


def test_decode_fast_path_gives_what_the_full_call_gives(target_model):
    """``CapturedForward.decode`` (one token a row, a few device copies) against ``__call__`` on the
    same inputs: the same logits and hidden states bit for bit, with padding rows (3 rows in a
    bucket of 4), across a context bucket (63 -> 64 -> 65 columns), and for a call spread over
    the slots from 0."""
    engines = [Engine(target_model, max_sequences=4, max_context=100, captured_steps="static") for _ in range(2)]
    ps = prompts([60, 61, 62], 4)
    for engine in engines:
        engine.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(ps)])
    fast, full = engines
    tokens = torch.tensor([7, 8, 9])
    for step in range(4):  # the longest row reaches columns 62, 63, 64, 65
        positions = torch.tensor([len(p) + step for p in ps])
        calls = []
        for engine in engines:
            batch = engine.start([SequenceInput(f"s{i}", len(p) + step, [int(tokens[i])]) for i, p in enumerate(ps)])
            if engine is fast:
                logits, hidden = fast.forward.decode(tokens, positions, int(positions.max()) + 1, batch.kv)
            else:
                columns, mask = write_columns_and_mask(positions[:, None], torch.ones(3, 1, dtype=torch.bool),
                                                       batch.scratch, int(positions.max()) + 1)
                out, hidden = full.forward(tokens[:, None], positions[:, None], columns, batch.kv, mask, 1)
                logits, hidden = out[:, -1], hidden[:, -1]
            batch.commit([1, 1, 1])
            calls.append((logits, hidden))
        assert torch.equal(calls[0][0], calls[1][0]) and torch.equal(calls[0][1], calls[1][1])
        tokens = calls[0][0].argmax(-1)
    assert fast.forward.replayed == full.forward.replayed == 4  # the decodes; the wide prefill ran eagerly
    # A call over slots 1 and 2 alone is spread over slots 0-2 (row 0 padding): the fast path, told
    # the rows, gives what __call__ gives on the spread inputs.
    full.forward.decode = None  # RaggedBatch.decode then takes __call__
    outputs = []
    for engine in engines:
        batch = engine.start([SequenceInput(f"s{i}", engine.length(f"s{i}"), [5]) for i in (1, 2)])
        assert batch.kv_rows == [1, 2] and batch.kv.shape[2] == 3
        batch.prefill(1)
        outputs.append((batch.decode(torch.tensor([6, 7])), batch.last_hidden()))
        batch.commit([2, 2])
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert fast.forward.eager == full.forward.eager == 1


def test_static_inputs_from_the_host_and_from_the_device_are_the_same(target_model):
    """``__call__`` fills the static buffers from host tensors in two copies (``_fill_from_host``)
    or from device ones slice by slice (``_fill_on_device``, where a call's tokens are already on
    the GPU): both leave the same values in every buffer, padding included, for a ragged tree call
    of 3 rows in a bucket of 4 × 8."""
    engine = Engine(target_model, max_sequences=4, max_context=100, captured_steps="static")
    forward = engine.forward
    fed = torch.tensor([[0, 0, 0, 11, 12], [0, 21, 22, 23, 24], [31, 32, 33, 34, 35]])
    valid = fed != 0
    kept = torch.tensor([7, 3, 40])
    positions = (kept[:, None] + valid.cumsum(1) - 1).clamp(min=0)
    parents = torch.tensor([[0, 0, 0, 1, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # row 2's last two: siblings
    columns, mask = write_columns_and_mask(positions, valid, 99, 46)
    sees = torch.ones(3, 5, 5, dtype=torch.bool).tril()
    sees[2, 4, 3] = False  # the last token of row 2 does not descend from the one before it
    mask = tree_mask(mask, columns, valid, sees & parents[:, :, None])
    filled = []
    for fill in (forward._fill_from_host, forward._fill_on_device):
        forward.ints.fill_(7)  # stale values from an earlier call
        forward.flags.fill_(True)
        fill(4, 8, fed, positions, columns, mask, 99)
        filled.append([t.clone() for t in (*forward._views(4, 8)[:3], *forward._tree_views(4, 8))])
    assert all(torch.equal(a, b) for a, b in zip(*filled))
    ids, _, real, columns_seen, _ = filled[0]
    assert ids[:3, 3:].tolist() == fed.tolist() and int(real.sum()) == int(valid.sum())
    assert int(ids[3].abs().sum()) == 0 and int(columns_seen[3].abs().sum()) == 0  # the padding row


@pytest.mark.parametrize("mode", ["off", "static"])
def test_a_call_out_of_slot_order_gets_each_sequence_its_own_results(target_model, draft_model, mode):
    """Rows run in slot order; a call that lists its sequences otherwise gets its results back in
    its own order (``RaggedBatch``'s reordering, skipped for calls already in slot order)."""
    ps = prompts([5, 9, 3], 6)
    results = []
    for order in ([0, 1, 2], [2, 0, 1]):
        draft = Engine(draft_model, max_sequences=4, max_context=64, captured_steps=mode)
        target = Engine(target_model, max_sequences=4, max_context=64, captured_steps=mode)
        for engine in (draft, target):
            engine.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(ps)])  # slots 0, 1, 2
        drafts = propose(draft, [ProposeItem(SequenceInput(f"s{i}", len(ps[i]), [5 + i]), 2 + i) for i in order])
        verdicts = verify(target, [VerifyItem(SequenceInput(f"s{i}", len(ps[i]), [5 + i]), d)
                                   for i, d in zip(order, drafts)])
        results.append({i: (d, v.accepted, v.next_token) for i, d, v in zip(order, drafts, verdicts)})
    assert results[0] == results[1]


def test_a_wide_row_catches_up_apart_and_the_propose_stays_captured(draft_model):
    """A new prompt in a draft's Propose (or a draft that fell behind) prefills its head in a
    forward of its own; the Propose's own forwards replay, and propose what the eager engine does."""
    ps, long = prompts([5, 6, 7], 9), prompts([40], 10)[0]
    proposed = []
    for mode in ("off", "static"):
        draft = Engine(draft_model, max_sequences=8, max_context=128, captured_steps=mode)
        draft.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(ps)])
        proposed.append(propose(draft, [ProposeItem(SequenceInput(f"s{i}", len(p), [9]), 3) for i, p in enumerate(ps)]
                                + [ProposeItem(SequenceInput("new", 0, long), 3)]))
    assert proposed[0] == proposed[1]
    assert draft.length("new") == len(long) + 2  # a plain draft keeps its prompt and its first k - 1 drafts
    assert counts(draft) == (4, 1)  # the prefill; the Propose's forward and two decodes | the head's 39 tokens


def speculate(target: Engine, draft: Engine, ps: list[list[int]], new_tokens: int, seed: int, leaves: int = 0) -> dict:
    """Greedy speculative decoding of every prompt, the way the coordinator steps: each step takes
    a batch of the unfinished sequences (all of them, a prefix of the slots, or a scattered few),
    drafts k (1-5) per sequence with ``leaves`` beside the first, verifies; finished sequences are
    released, and one more half-way (slots move)."""
    rng = random.Random(seed)
    history = {f"s{i}": list(p) for i, p in enumerate(ps)}
    prompt_len = {sid: len(h) for sid, h in history.items()}
    cached = {sid: 0 for sid in history}  # target-side
    draft_cached = {sid: 0 for sid in history}
    done: dict[str, list[int]] = {}
    for step in range(200):
        live = [sid for sid in history if sid not in done]
        if not live:
            break
        if step == 3 and len(live) > 2:  # free a slot in the middle: the rest move down
            gone = live[1]
            done[gone] = history[gone][prompt_len[gone]:]
            target.run(target.release, [gone])
            draft.run(draft.release, [gone])
            live.remove(gone)
        shape = step % 3
        batch = live if shape == 0 else live[: max(1, len(live) - 1)] if shape == 1 else live[::2]
        proposed = proposals(draft, [ProposeItem(SequenceInput(sid, draft_cached[sid], history[sid][draft_cached[sid]:]),
                                                 rng.randint(1, 5), leaves=[leaves] if leaves else []) for sid in batch])
        verdicts = verify(target, [VerifyItem(SequenceInput(sid, cached[sid], history[sid][cached[sid]:]), p.tokens,
                                              leaves=p.leaves) for sid, p in zip(batch, proposed)], create=True)
        for sid, drafts, verdict in zip(batch, [p.tokens for p in proposed], verdicts):
            # The draft cached its history and its first k-1 drafts: keep those that were accepted.
            draft_cached[sid] = len(history[sid]) + min(verdict.accepted, len(drafts) - 1)
            leaf = [] if verdict.leaf is None else [verdict.leaf]
            history[sid] += drafts[: verdict.accepted] + leaf + [verdict.next_token]
            cached[sid] = verdict.cached_len
            if len(history[sid]) - prompt_len[sid] >= new_tokens:  # finished: released, as the coordinator does
                done[sid] = history[sid][prompt_len[sid]:][:new_tokens]
                target.run(target.release, [sid])
                draft.run(draft.release, [sid])
    return done


@pytest.mark.parametrize("leaves", [0, 2])
def test_speculative_decoding_through_the_static_path_equals_eager(target_model, draft_model, leaves):
    """With leaves, the target's calls are trees: their mask and positions take the static path too."""
    ps = prompts([4, 11, 2, 25, 7, 3], 2)  # six sequences: batches of 1 to 6 fall between buckets
    results, engines = [], []
    for mode in ("off", "static"):
        target = Engine(target_model, max_sequences=8, max_context=128, captured_steps=mode)
        draft = Engine(draft_model, max_sequences=8, max_context=128, captured_steps=mode)
        results.append(speculate(target, draft, ps, 24, seed=3, leaves=leaves))
        engines.append((target, draft))
    eager, static = results
    assert static == eager
    target, draft = engines[1]
    assert target.forward.replayed > 10 and draft.forward.replayed > 20
    # Scattered batches (every other sequence, slots moved down) are spread over the slots from 0
    # and replayed: only the target's calls wider than every bucket (the longest prompt) ran
    # eagerly; the draft caught that prompt's head up apart, in a call that fits (Engine.catch_up).
    assert target.forward.eager > 0 and set(target.forward.eager_reasons) == {"tokens past every bucket"}
    assert draft.forward.eager == 0
    # Speculative decoding is exact: the target's own greedy decoding, for the ones not cut short.
    for sid in ("s0", "s3"):
        i = int(sid[1:])
        assert static[sid] == greedy_reference(target_model, ps[i], 24)


def test_opt_models_take_the_static_path_too():
    """The paper's GPU shapes are OPT: its own forward (specbatch.models.opt) runs padded and static,
    token for token as eagerly."""
    target_opt, draft_opt = tiny_opt(2, seed=11), tiny_opt(1, seed=12)
    ps = prompts([5, 9, 3], 5)
    results = []
    for mode in ("off", "static"):
        target = Engine(target_opt, max_sequences=4, max_context=96, captured_steps=mode)
        draft = Engine(draft_opt, max_sequences=4, max_context=96, captured_steps=mode)
        assert target.implementation == "specbatch"
        results.append(speculate(target, draft, ps, 16, seed=4))
    assert results[1] == results[0]
    assert target.forward.replayed > 5
    assert results[1]["s0"] == greedy_reference(target_opt, ps[0], 16)


# ---- the pool stays put ------------------------------------------------------------------------


def test_pool_is_allocated_once_and_growth_is_refused(target_model):
    engine = Engine(target_model, max_sequences=4, max_context=100, captured_steps="static")
    assert engine.pool.fixed and engine.pool.slots == 4 and engine.pool.context == 101
    address = engine.pool.kv.data_ptr()
    ps = prompts([50, 3, 99, 8], 4)
    engine.prefill([SequenceInput(f"s{i}", 0, p) for i, p in enumerate(ps)])
    verify(engine, [VerifyItem(SequenceInput(f"s{i}", len(p), [3]), []) for i, p in enumerate(ps[:2])])
    engine.release(["s0"])
    assert engine.pool.kv.data_ptr() == address

    # A budget of two sequences of 100 tokens: two slots, and a third sequence is refused.
    per_sequence = engine.pool.bytes_for(1, 101)
    small = Engine(target_model, max_sequences=4, max_context=100, max_cache_bytes=2 * per_sequence + 1,
                   captured_steps="static")
    assert small.pool.slots == 2
    small.prefill([SequenceInput("a", 0, [1, 5]), SequenceInput("b", 0, [1, 6])])
    with pytest.raises(CapacityExceeded, match="allocated once"):
        small.prefill([SequenceInput("c", 0, [1, 7])])
    assert set(small.sequences) == {"a", "b"}
    with pytest.raises(CapacityExceeded):
        Engine(target_model, max_sequences=4, max_context=100, max_cache_bytes=per_sequence - 1, captured_steps="static")


def test_a_moved_pool_drops_its_graphs_and_buffers(target_model):
    engine = Engine(target_model, max_sequences=4, max_context=100, captured_steps="static")
    forward = engine.forward
    forward.graphs[(1, 1, 64)] = object()  # stands in for a captured graph
    engine.pool.kv = engine.pool.kv.clone()  # what a reallocation would do
    engine.prefill([SequenceInput("a", 0, [1, 5])])
    assert forward.graphs == {} and forward.pool_address == engine.pool.kv.data_ptr()
    assert forward.replayed == 1


# ---- CUDA graphs, where a GPU is -----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("leaves", [0, 2])
def test_cuda_graphs_capture_and_replay_like_eager(target_model, draft_model, leaves):
    import copy

    ps = prompts([4, 11, 2, 25, 7, 3], 2)
    results = []
    for mode in ("off", "on"):
        target = Engine(copy.deepcopy(target_model).cuda(), max_sequences=8, max_context=128, captured_steps=mode)
        draft = Engine(copy.deepcopy(draft_model).cuda(), max_sequences=8, max_context=128, captured_steps=mode)
        results.append(speculate(target, draft, ps, 24, seed=3, leaves=leaves))
    assert results[0] == results[1]
    assert target.capture_report["graphs"] == len(target.forward.graphs) > 0
    assert target.forward.replayed > 10 and draft.forward.replayed > 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_greedy_draft_loop_never_waits_for_the_gpu(draft_model):
    """The forwards of a step run without one host synchronisation (host-built inputs reach the
    GPU through pinned memory): only reading the tokens back waits."""
    import copy

    draft = Engine(copy.deepcopy(draft_model).cuda(), max_sequences=4, max_context=128, captured_steps="on")
    draft.prefill([SequenceInput("a", 0, prompts([9], 7)[0])])
    batch = draft.start([SequenceInput("a", 9, [5])], decode_steps=3)
    replayed = draft.forward.replayed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = batch.prefill(1)[:, -1].argmax(-1)
        for _ in range(3):
            tokens = batch.decode(tokens).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.tolist()
    assert draft.forward.replayed == replayed + 4


@pytest.mark.parametrize("eagle", [False, True])
def test_served_with_captured_steps_only_prompts_run_eagerly(target_model, draft_model, tokenizer, eagle):
    """Through the coordinator (requests coming and going, prompt lookup leaving some rows to the
    draft), every decode and verify call of both services takes the static path; only calls with
    a row wider than every bucket (a prompt, at most once a request and service) run eagerly, and
    the outputs stay the target's own. On a GPU any other eager call costs a step several times
    over: a Propose over the rows lookup left to the draft once ran eagerly every step, and an
    EAGLE draft's Propose (which takes a new request's prompt with the target's features) ran
    eagerly whole, decodes included, until the prompt's head was caught up apart."""
    from test_exactness import prompts_of_lengths, run_staggered_and_check

    from specbatch.models.eagle import draft_from_target
    from specbatch.stack.in_process import start_local_stack

    options = {"captured_steps": "static", "max_sequences": 8, "max_context": 256}
    draft = draft_from_target(target_model).eval() if eagle else draft_model
    stack = start_local_stack(target_model, draft, tokenizer, target_engine_options=options,
                              draft_engine_options=options, max_batch_size=8, max_new_tokens=64, speculation=SpeculationConfig(k_policy="fixed:3", prompt_lookup=3))
    try:
        prompts = prompts_of_lengths([1 + (i * 7) % 41 for i in range(12)], seed=5)
        run_staggered_and_check(stack.client(), target_model, prompts, [12 + (i * 5) % 29 for i in range(12)])
        for engine in (stack.target_engine, stack.draft_engine):
            assert engine.forward.replayed > 20
            assert set(engine.forward.eager_reasons) <= {"tokens past every bucket"}, engine.forward.eager_reasons
            assert engine.forward.eager <= len(prompts)
    finally:
        stack.stop()

"""The EAGLE-style draft: it reads the target's features, through the engine, the services and the
coordinator, and ``specbatch distill`` trains one that the draft service serves."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest
import torch
from tiny import VOCAB, greedy_mixed_batch, greedy_reference, random_prompts

from draft_service.proposer import ProposeItem, propose
from specbatch.commands.distill.config import DistillConfig, amp_dtype
from specbatch.commands.distill.run import distill
from specbatch.config.speculation import SpeculationConfig
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.models.eagle import draft_from_target, reads_target_features
from specbatch.protocol.errors import InvalidRequest
from specbatch.rpc.client import generate, generate_all, make_request
from target_service.verifier import VerifyItem, verify

SMALL = DistillConfig(prompts=24, max_new_tokens=24, max_prompt_tokens=24, corpus_tokens=400, corpus_max_tokens=40,
                      data_batch=12, draft_vocab=64, steps=60, batch_sequences=8, lr=3e-3, checkpoint_every=20,
                      eval_prompts=3, eval_k=3, eval_new_tokens=16)


@pytest.fixture(scope="module")
def distilled(target_model, tokenizer, tmp_path_factory):
    """A draft distilled for the tiny target (seconds): its folder and evaluation."""
    out = tmp_path_factory.mktemp("distill")
    evaluation = distill(copy.deepcopy(target_model), tokenizer, out, SMALL)
    return out, evaluation


@pytest.fixture(scope="module")
def eagle_draft(distilled):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(distilled[0] / "draft").eval()


def test_distill_writes_a_checkpoint_that_loads_and_learned(distilled, eagle_draft, target_model):
    out, evaluation = distilled
    assert reads_target_features(eagle_draft)
    assert (out / "draft" / "model.safetensors").exists() and (out / "draft" / "tokenizer.json").exists()
    assert eagle_draft.config.draft_vocab_size == SMALL.draft_vocab
    # Its head holds the target's rows for its token subset; the subset maps back to token ids.
    subset = eagle_draft.draft_to_target
    assert torch.equal(eagle_draft.lm_head.weight, target_model.lm_head.weight[subset])
    saved = json.loads((out / "evaluation.json").read_text())
    assert saved["k"] == 3 and len(saved["acceptance_by_position"]) == 3
    # Far above what an untrained draft gets on a 96-token vocabulary (about 1/96).
    assert evaluation.acceptance > 0.2, evaluation


def test_distill_resumes_where_it_stopped(distilled, target_model, tokenizer, tmp_path):
    """A second run over a finished folder redoes no data or training: the same draft comes out."""
    out, _ = distilled
    again = tmp_path / "again"
    for part in ("data", "checkpoint"):
        (again / part).mkdir(parents=True)
        for file in (out / part).iterdir():
            (again / part / file.name).write_bytes(file.read_bytes())
    evaluation = distill(copy.deepcopy(target_model), tokenizer, again, SMALL)
    first = torch.load(out / "checkpoint" / "state.pt")["draft"]
    second = torch.load(again / "checkpoint" / "state.pt")["draft"]
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert evaluation.acceptance == distilled[1].acceptance


def _features_for(target, prompt: list[int]) -> torch.Tensor:
    engine = Engine(target)
    (verdict,) = verify(engine, [VerifyItem(SequenceInput("s", 0, prompt))], create=True, return_features=True)
    return verdict.features.float()


def test_target_returns_the_hidden_states_its_head_reads(target_model):
    prompt = [1, 7, 9, 30, 44, 12]
    features = _features_for(target_model, prompt)
    assert features.shape == (len(prompt), target_model.config.hidden_size)
    with torch.no_grad():
        reference = target_model(torch.tensor([prompt]), output_hidden_states=False)
        logits = target_model.lm_head(features)
    assert torch.allclose(logits, reference.logits[0], atol=0.05)


def test_proposals_equal_a_plain_forward_of_the_draft(target_model, eagle_draft):
    """Ragged batched drafting with the pool (k tokens, own features fed back) matches running the
    draft's layers by hand on each sequence alone."""
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(5, VOCAB) for _ in range(n)] for n in (4, 11, 7)]
    engine = Engine(eagle_draft)
    items = []
    expected = []
    for i, prompt in enumerate(prompts):
        features = _features_for(target_model, prompt)
        fed = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])
        items.append(ProposeItem(SequenceInput(f"s{i}", 0, prompt, fed), k=3 + i))
        tokens, reads = list(prompt), fed
        drafted = []
        with torch.no_grad():
            for _ in range(3 + i):
                hidden = eagle_draft.model(input_ids=torch.tensor([tokens]), target_features=reads[None]).last_hidden_state
                token = int(eagle_draft.draft_to_target[eagle_draft.lm_head(hidden[0, -1]).argmax()])
                drafted.append(token)
                tokens.append(token)
                reads = torch.cat([reads, hidden[0, -1:]])
        expected.append(drafted)
    assert propose(engine, items) == expected
    # It keeps only what it read with the target's features: its drafts are not cached.
    assert [engine.length(f"s{i}") for i in range(3)] == [len(p) for p in prompts]


def test_proposals_through_the_static_padded_path_equal_eager(target_model, eagle_draft):
    """The draft reads target features: they are padded into the static buffers like the tokens
    (specbatch.engine.captured), and the proposals stay the same."""
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(5, VOCAB) for _ in range(n)] for n in (4, 11, 7)]
    fed = [torch.cat([torch.zeros(1, f.shape[1]), f[:-1]]) for f in (_features_for(target_model, p) for p in prompts)]
    items = lambda: [ProposeItem(SequenceInput(f"s{i}", 0, p, f), k=2 + i)  # noqa: E731
                     for i, (p, f) in enumerate(zip(prompts, fed))]
    static = Engine(eagle_draft, max_sequences=4, max_context=64, captured_steps="static")
    assert propose(static, items()) == propose(Engine(eagle_draft, max_sequences=4, max_context=64), items())
    assert static.forward.replayed == 4 and static.forward.eager == 0  # the prefill and 3 decodes


def test_feature_shape_is_checked(eagle_draft):
    engine = Engine(eagle_draft)
    with pytest.raises(InvalidRequest, match="feature"):
        propose(engine, [ProposeItem(SequenceInput("s", 0, [1, 5, 6]), k=2)])
    with pytest.raises(InvalidRequest, match="feature"):
        propose(engine, [ProposeItem(SequenceInput("s", 0, [1, 5, 6], torch.zeros(2, 64)), k=2)])
    assert not engine.sequences


@pytest.mark.parametrize("weights", [None, "q8_0"])
def test_malformed_features_are_refused_and_change_nothing(target_model, eagle_draft, tokenizer, weights):
    """Features that are not whole float16 values, or not finite, get INVALID_ARGUMENT from the
    draft service, and the refused call leaves no sequence behind (Q8_0 too, whose activations
    are quantized from them)."""
    import grpc
    import numpy as np

    from specbatch.stack.in_process import start_local_stack
    from specbatch.v1 import model_services_pb2 as mpb
    from specbatch.v1 import model_services_pb2_grpc as mpb_grpc

    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=16,
                              draft_engine_options={"weights": weights} if weights else None)
    try:
        width = stack.draft_engine.feature_size
        nan = np.full((2, width), np.nan, dtype="<f2").tobytes()
        with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
            draft = mpb_grpc.DraftStub(channel)
            for features in (b"\x01\x02\x03", nan, np.full((2, width), np.inf, dtype="<f2").tobytes()):
                sequence = mpb.SequenceInput(seq_id="odd", tokens=[1, 2], features=features)
                for call in (lambda: draft.Prefill(mpb.PrefillRequest(sequences=[sequence]), timeout=10),
                             lambda: draft.Propose(mpb.ProposeRequest(items=[mpb.ProposeItem(sequence=sequence, k=2)]),
                                                   timeout=10)):
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
                    assert not stack.draft_engine.sequences
    finally:
        stack.stop()


@pytest.fixture
def eagle_stack(target_model, eagle_draft, tokenizer):
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=128)
    yield stack
    stack.stop()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_an_eagle_draft_matches_generate(eagle_stack, target_model, k):
    """Ten requests through a batch of at most four: the draft reads the features the target
    returns, drafts get accepted, and every output is token-identical to target-only decoding."""
    prompts = random_prompts(k, 10)
    requests = [make_request(p, 30, k=k, ignore_eos=True) for p in prompts]
    results = generate_all(eagle_stack.client(), requests, concurrency=10)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, 30)
    assert sum(r.stats.draft_tokens_accepted for r in results) > 0
    assert not eagle_stack.draft_engine.sequences and not eagle_stack.target_engine.sequences


def decode_exactly(stack, target_model, seed: int, count: int, k: int) -> list:
    """``count`` random prompts × 30 greedy tokens through ``stack`` at k, all at once; each output
    must be target-only decoding, token for token. Returns the results."""
    prompts = random_prompts(seed, count)
    results = generate_all(stack.client(), [make_request(p, 30, k=k, ignore_eos=True) for p in prompts],
                           concurrency=count)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, 30)
    return results


@pytest.mark.parametrize("eagle, leaves", [(True, 3), (False, 3), (False, 1)])
def test_greedy_output_with_leaves_matches_generate(target_model, eagle_draft, draft_model, tokenizer, eagle, leaves):
    """Leaves beside the first drafted token, through the services: kept leaves move their keys
    and values (and, for an EAGLE draft, their features) into the history; every output is still
    token-identical to target-only decoding."""
    from specbatch.stack.in_process import start_local_stack

    # fixed:2 verifies every leaf offered (learn, the default, only those it prices to pay)
    stack = start_local_stack(target_model, eagle_draft if eagle else draft_model, tokenizer, max_batch_size=4,
                              max_new_tokens=64, speculation=SpeculationConfig(k_policy="fixed:2", leaves=leaves))
    try:
        decode_exactly(stack, target_model, seed=9, count=8, k=2)
        totals = stack.coordinator.scheduler.totals
        assert totals.leaf_hits > 0 and totals.leaf_chances > totals.leaf_hits, vars(totals)
    finally:
        stack.stop()


def test_q8_0_eagle_draft_keeps_the_output_exact(target_model, eagle_draft, tokenizer):
    """A draft with its linear layers in Q8_0 blocks proposes other tokens now and then; the target
    decides every one, so the output is still target-only decoding, token for token."""
    from specbatch.kernels import build
    from specbatch.stack.in_process import start_local_stack

    if not build.blocks_available():
        pytest.skip("the GGUF block kernels did not build here")
    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=4, max_new_tokens=64,
                              draft_engine_options={"weights": "q8_0"})
    try:
        results = decode_exactly(stack, target_model, seed=7, count=6, k=3)
        assert sum(r.stats.draft_tokens_accepted for r in results) > 0
        forward = stack.draft_engines[0].forward
        assert forward.layers[0].down.q8_0 and forward.head.q8_0 and forward.decoder_layers is not None
        assert forward.fuse.bf16_weights  # float32 inputs: it reads the raw features
    finally:
        stack.stop()


@pytest.mark.parametrize("form", ["bf16", "bf16-dot", "fp16-dot"])
def test_bf16_weights_speculate_exactly_against_their_own_target_only_decoding(target_model, eagle_draft, tokenizer,
                                                                             form):
    """Target and draft with their weights kept in bf16 (float32 arithmetic on the panel kernel), or
    with the layers' inputs rounded to bf16 too (bf16 dot products), or both in float16 with
    float16 products: the target's rows do not depend
    on how many share a multiply, so speculative output at k=3, with leaves, in one mixed batch, is
    token for token the same stack's target-only (k=0) output."""
    from specbatch.kernels import build
    from specbatch.stack.in_process import start_local_stack

    if not build.available():
        pytest.skip(f"no panel kernel here: {build.unavailable_reason()}")
    if form == "bf16-dot" and not build.bf16_dot_available():
        pytest.skip("the CPU lacks AVX512_BF16")
    if form == "fp16-dot" and not build.fp16_dot_available():
        pytest.skip("the CPU lacks AVX512_FP16")
    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=64,
                              target_engine_options={"weights": form}, draft_engine_options={"weights": form})
    try:
        outputs = {k: [r.token_ids for r in greedy_mixed_batch(stack, seed=11, k=k)] for k in (0, 3)}
        assert outputs[3] == outputs[0]
        attribute = {"bf16": "bf16_weights"}.get(form, form.replace("-", "_"))
        assert getattr(stack.target_engines[0].forward.layers[0].down, attribute)
        assert getattr(stack.draft_engines[0].forward.fuse, attribute)
    finally:
        stack.stop()
    with pytest.raises(ValueError, match="bf16|float16"):
        Engine(copy.deepcopy(target_model).to(torch.bfloat16), weights=form)
    with pytest.raises(ValueError, match="bf16|float16"):
        Engine(target_model, implementation="transformers", weights=form)


def test_eagle_draft_rebuilt_after_losing_its_state(eagle_stack, target_model, tokenizer):
    """The draft forgets everything mid-request: the coordinator re-sends history and features."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "w3 w9 w27"}], tokenize=False,
                                           add_generation_prompt=True)
    prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    client = eagle_stack.client()
    engine = eagle_stack.draft_engine
    responses = []

    def forget_every_third(response):
        responses.append(response)
        if len(responses) % 3 == 0:
            engine.run(lambda: engine.release(list(engine.sequences)))

    result = generate(client, make_request(prompt, 60, k=3, ignore_eos=True), on_response=forget_every_third)
    assert result.token_ids == greedy_reference(target_model, prompt, 60)
    assert len(responses) > 6 and result.stats.draft_tokens_accepted > 0


def test_trained_only_export_reassembles_with_the_target(eagle_draft, target_model, tmp_path):
    """The embedded default ships only its trained weights; adding the target's embeddings and
    head rows back gives the same draft (to float16 rounding) and the same proposals."""
    from specbatch.commands.distill.train import export_trained_only
    from specbatch.models.embedded import TRAINED_WEIGHTS
    from specbatch.models.loading import assemble_draft

    export_trained_only(eagle_draft, tmp_path)
    assert (tmp_path / TRAINED_WEIGHTS).stat().st_size < 0.6 * sum(
        p.numel() * 4 for p in eagle_draft.parameters())  # float16, and no embeddings or head
    rebuilt = assemble_draft(tmp_path, target_model)
    assert torch.equal(rebuilt.draft_to_target, eagle_draft.draft_to_target)
    features = _features_for(target_model, [1, 7, 9, 30, 44, 12])
    fed = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])
    items = lambda: [ProposeItem(SequenceInput("s", 0, [1, 7, 9, 30, 44, 12], fed), k=4)]  # noqa: E731
    assert propose(Engine(rebuilt), items()) == propose(Engine(eagle_draft), items())


def test_draft_service_process_serves_the_distilled_folder(distilled, target_model, tokenizer, tmp_path, zygote):
    """``python -m draft_service --model OUT/draft``: the checkpoint loads like any model."""
    from specbatch.rpc.client import connect
    from specbatch.stack.defaults import StackOptions, free_port
    from specbatch.stack.processes import LocalProcesses
    from specbatch.v1 import generation_pb2 as gpb

    target_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    options = StackOptions(target_model=str(tmp_path), dtype="float32", draft_model=str(distilled[0] / "draft"), ports=ports,
                           max_batch_size=4)
    with LocalProcesses(options, zygote.start) as stack:
        stub = connect(stack.address)
        prompt = [1, 7, 22, 9, 40]
        result = generate(stub, make_request(prompt, 30, k=3, ignore_eos=True))
        assert "draft" in stub.Info(gpb.InfoRequest()).draft_model
    assert result.token_ids == greedy_reference(target_model, prompt, 30)
    assert result.stats.draft_tokens_proposed > 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_distill_trains_and_evaluates_on_the_targets_device(target_model, tokenizer, tmp_path, monkeypatch, device):
    """The draft is made where the target is; every training batch and the evaluation's drafting
    reach it there (a pre-hook on the draft records the device of what it is fed)."""
    import specbatch.commands.distill.run as distill_module

    fed: dict[bool, set] = {True: set(), False: set()}  # draft.training -> devices of its inputs
    made = []

    def recorded_draft(*args, **kwargs):
        draft = draft_from_target(*args, **kwargs)

        def record(module, args, kwargs):
            inputs = [kwargs.get("input_ids"), kwargs.get("target_features")]
            fed[module.training].update(t.device for t in inputs if t is not None)

        draft.register_forward_pre_hook(record, with_kwargs=True)
        draft.model.register_forward_pre_hook(record, with_kwargs=True)
        made.append(draft)
        return draft

    monkeypatch.setattr(distill_module, "draft_from_target", recorded_draft)
    cfg = dataclasses.replace(SMALL, prompts=4, corpus_tokens=80, steps=3, eval_prompts=1, eval_new_tokens=6)
    distill(copy.deepcopy(target_model).to(device), tokenizer, tmp_path, cfg)
    expected = {torch.device(device).type}
    assert {d.type for d in fed[True]} == expected  # training batches
    assert {d.type for d in fed[False]} == expected  # evaluation
    assert made[0].device.type == torch.device(device).type


def test_bf16_autocast_is_a_flag(target_model, tokenizer, tmp_path, monkeypatch):
    """``--amp bf16`` runs the draft's training forward under bf16 autocast (off by default on a CPU)."""
    import specbatch.commands.distill.run as distill_module

    seen = []

    def recorded_draft(*args, **kwargs):
        draft = draft_from_target(*args, **kwargs)
        draft.model.register_forward_pre_hook(
            lambda module, args: seen.append((module.training, torch.is_autocast_enabled("cpu"))))
        return draft

    monkeypatch.setattr(distill_module, "draft_from_target", recorded_draft)
    assert amp_dtype("cpu", "auto") is None and amp_dtype("cuda", "auto") == torch.bfloat16
    cfg = dataclasses.replace(SMALL, prompts=4, corpus_tokens=80, steps=2, eval_prompts=1, eval_new_tokens=4, amp="bf16")
    distill(copy.deepcopy(target_model), tokenizer, tmp_path, cfg)
    assert {autocast for training, autocast in seen if training} == {True}
    assert {autocast for training, autocast in seen if not training} == {False}  # drafting is not autocast


def test_distill_fine_tunes_a_draft_against_the_target_in_a_weight_form(distilled, eagle_draft, target_model,
                                                                       tokenizer, tmp_path, monkeypatch):
    """``--init-draft`` starts from a distilled draft (its head's token subset kept, its head rows
    frozen) and ``--weights`` builds every target engine of the data and evaluate phases in that
    form: a draft tuned to the target as a CPU serves it."""
    import specbatch.commands.distill.data as data_module
    import specbatch.commands.distill.evaluate as evaluate_module
    from specbatch.kernels import build

    if not build.available():
        pytest.skip(f"no panel kernel here: {build.unavailable_reason()}")
    forms = []

    class Recorded(Engine):
        def __init__(self, model, *args, **kwargs):
            forms.append((reads_target_features(model), kwargs.get("weights")))
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(data_module, "Engine", Recorded)
    monkeypatch.setattr(evaluate_module, "Engine", Recorded)
    cfg = dataclasses.replace(SMALL, prompts=4, corpus_tokens=80, steps=4, lr=1e-3, eval_prompts=1, eval_new_tokens=4,
                              weights="bf16", init_draft=str(distilled[0] / "draft"))
    distill(copy.deepcopy(target_model), tokenizer, tmp_path, cfg)
    # the answers, the corpus and the evaluation's target in bf16; the evaluation's draft as loaded
    assert forms == [(False, "bf16"), (False, "bf16"), (False, "bf16"), (True, None)]
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert torch.equal(tuned.draft_to_target, eagle_draft.draft_to_target)
    assert torch.equal(tuned.lm_head.weight, eagle_draft.lm_head.weight)
    start, end = eagle_draft.model.fc.weight, tuned.model.fc.weight
    assert not torch.equal(start, end) and (end - start).abs().max() < 0.1  # moved, from where it started


def _random_sequences(rng: random.Random, count: int, fed_all: bool) -> list[dict]:
    sequences = []
    for _ in range(count):
        n = rng.randrange(2, 12)
        sequences.append({"tokens": torch.tensor([rng.randrange(VOCAB) for _ in range(n)], dtype=torch.int32),
                          "features": torch.randn(n if fed_all else n - 1, 8).half()})
    return sequences


def test_feature_shards_read_back_what_was_written_one_shard_at_a_time(tmp_path):
    """The data phase's shards hold the same sequences it made (answers: a feature per fed token,
    one fewer than their tokens; corpus: one per token), read lazily: a sequence opens only its
    own shard, and at most ``max_open`` stay open."""
    from specbatch.commands.distill.data import FeatureShards, _sharded

    rng = random.Random(5)
    made = {0: _random_sequences(rng, 3, False), 1: _random_sequences(rng, 4, True), 2: _random_sequences(rng, 2, False)}
    # Shard 1 is left as a run started before this format would have left it: resuming converts it.
    torch.save(made[1], tmp_path / "s-0001.pt")
    paths = _sharded(tmp_path, "s", [None] * 3, "shards", lambda index, _: made[index])
    expected = made[0] + made[1] + made[2]

    data = FeatureShards(paths, max_open=2)
    assert len(data) == len(expected) and not data.opened
    fourth = data[4]  # in shard 1
    assert list(data.opened) == [1]
    assert torch.equal(fourth["tokens"], expected[4]["tokens"]) and torch.equal(fourth["features"], expected[4]["features"])
    for got, want in zip(data, expected):
        assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["features"], want["features"])
    assert len(data.opened) == 2
    assert [t.tolist() for t in data.token_sequences()] == [s["tokens"].tolist() for s in expected]
    # A re-run keeps the shards it finds: nothing is made again.
    assert _sharded(tmp_path, "s", [None] * 3, "shards", lambda *_: pytest.fail("remade a shard")) == paths


def test_training_batch_reads_each_feature_one_position_later(tmp_path):
    from specbatch.commands.distill.train import _batch

    sequences = _random_sequences(random.Random(1), 3, False)
    ids, inputs, labels, mask = _batch(sequences, 8)
    for row, seq in enumerate(sequences):
        n = len(seq["features"])
        assert torch.equal(ids[row, :n], seq["tokens"][:n].long())
        assert torch.equal(labels[row, :n], seq["features"].float())
        assert torch.equal(inputs[row, 1:n], seq["features"][: n - 1].float())
        assert not inputs[row, 0].any() and not inputs[row, n:].any()
        assert mask[row].tolist() == [False] + [True] * (n - 1) + [False] * (ids.shape[1] - n)


def test_fused_target_returns_layer_outputs_beside_its_final_state_and_the_same_logits(target_model):
    """EAGLE-3's fusion on the target side: the features it returns are the chosen decoder layers'
    outputs and the final hidden state, concatenated; its next tokens do not change."""
    from specbatch.models.eagle import fuse_target_features, target_feature_size

    prompt = [1, 7, 9, 30, 44, 12]
    plain = _features_for(target_model, prompt)
    fused_model = fuse_target_features(copy.deepcopy(target_model), [0, 1])
    hidden = target_model.config.hidden_size
    assert target_feature_size(fused_model) == 3 * hidden and target_feature_size(target_model) == hidden
    fused = _features_for(fused_model, prompt)
    assert fused.shape == (len(prompt), 3 * hidden)
    with torch.no_grad():
        reference = target_model(torch.tensor([prompt]), output_hidden_states=True)
        assert torch.equal(fused_model(torch.tensor([prompt])).logits, reference.logits)
    assert torch.allclose(fused[:, -hidden:], plain, atol=1e-2)  # float16 on the way out
    for slot, layer in enumerate([0, 1]):  # hidden_states[i + 1] is layer i's output
        assert torch.allclose(fused[:, slot * hidden : (slot + 1) * hidden], reference.hidden_states[layer + 1][0], atol=1e-2)
    from specbatch.service.servicer import features_to_bytes

    assert len(features_to_bytes(fused)) == len(prompt) * 2 * 3 * hidden  # float16 on the wire: 3× the bytes


def test_distill_with_fused_features_and_two_layers_serves_exactly(target_model, tokenizer, tmp_path):
    """``--feature-layers 0,1 --layers 2``: the draft reads the fused features, learns, round-trips
    through the trained-only form, and through the services the output stays the target's."""
    from specbatch.commands.distill.train import export_trained_only
    from specbatch.models.eagle import fuse_target_features
    from specbatch.models.loading import assemble_draft
    from specbatch.stack.in_process import start_local_stack

    cfg = dataclasses.replace(SMALL, feature_layers="0,1", layers=2)
    target = copy.deepcopy(target_model)
    evaluation = distill(target, tokenizer, tmp_path, cfg)
    # Ten times chance (1/96). Lower than the plain draft's bar: on 1.4 k tokens of a random tiny
    # model the extra inputs overfit (training agreement 0.67, held-out first position ~0.4).
    assert evaluation.acceptance > 0.1, evaluation
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    assert draft.config.feature_layers == [0, 1] and draft.config.num_hidden_layers == 2
    assert draft.config.feature_size == 3 * target_model.config.hidden_size
    export_trained_only(draft, tmp_path / "shipped")
    rebuilt = assemble_draft(tmp_path / "shipped", target_model)
    assert rebuilt.config.feature_layers == [0, 1]

    served_target = fuse_target_features(copy.deepcopy(target_model), [0, 1])
    stack = start_local_stack(served_target, rebuilt, tokenizer, max_batch_size=4, max_new_tokens=64)
    try:
        rng = random.Random(2)
        prompts = [[1] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
        results = generate_all(stack.client(), [make_request(p, 24, k=3, ignore_eos=True) for p in prompts], concurrency=4)
    finally:
        stack.stop()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(target_model, prompt, 24)
    assert sum(r.stats.draft_tokens_accepted for r in results) > 0


def test_training_prompts_stop_before_the_held_out_conversations():
    """However many prompts distill asks for, none comes from the evaluation's range."""
    from specbatch.commands.distill.data import EVAL_PROMPTS_FROM
    from specbatch.commands.prompts import sharegpt_exchanges

    tail = sharegpt_exchanges(10**6, start=EVAL_PROMPTS_FROM - 12, end=EVAL_PROMPTS_FROM)
    assert 0 < len(tail) <= 12
    held_out = sharegpt_exchanges(3, start=EVAL_PROMPTS_FROM)
    assert not set(held_out) & set(tail)


def test_mt_bench_prompts_cover_every_category():
    from specbatch.commands.prompts import mt_bench_prompts

    prompts = mt_bench_prompts(per_category=3)
    assert len(prompts) == 24 and len(set(prompts)) == 24
    assert prompts[0].startswith("Compose an engaging travel blog post")


def test_draft_eval_script_compares_drafts_in_one_run(distilled, eagle_draft, target_model, tokenizer, tmp_path):
    """benchmarks/draft_eval.py on the tiny target: a model folder, a trained-only folder and a
    draft on fused features, side by side; one row per draft and prompt source, in JSON too."""
    import importlib.util
    from pathlib import Path

    from specbatch.commands.distill.train import export_trained_only

    target_model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    export_trained_only(eagle_draft, tmp_path / "trained-only")
    fused_cfg = dataclasses.replace(SMALL, feature_layers="1", steps=3, eval_prompts=1, eval_new_tokens=4)
    distill(copy.deepcopy(target_model), tokenizer, tmp_path / "fused", fused_cfg)
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "draft_eval.py"
    spec = importlib.util.spec_from_file_location("draft_eval", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    drafts = {"folder": distilled[0] / "draft", "trained-only": tmp_path / "trained-only", "fused": tmp_path / "fused" / "draft"}
    argv = ["--target", str(tmp_path / "target"), "--sources", "sharegpt", "--prompts", "2", "--k", "3",
            "--new-tokens", "8", "--device", "cpu", "--out", str(tmp_path / "eval.json")]
    assert script.main(argv + [arg for label, folder in drafts.items() for arg in ("--draft", f"{label}={folder}")]) == 0
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["draft"] for r in results] == list(drafts)
    by_label = {r["draft"]: r["evaluation"] for r in results}
    assert all(len(e["acceptance_by_position"]) == 3 and e["prompts"] == 2 for e in by_label.values())
    assert by_label["folder"]["acceptance_by_position"] == by_label["trained-only"]["acceptance_by_position"]


def test_the_services_through_the_padded_static_path_stay_exact(target_model, eagle_draft, tokenizer):
    """Both engines on the captured steps' padded path (``static``: what CUDA graphs replay, run
    eagerly): the target's features cross the wire to the draft, calls come from the host
    (``CapturedForward._fill_from_host``), the draft's decode steps take ``CapturedForward.decode``.
    Speculative output at k=3 with leaves, in one mixed batch, is the same stack's k=0 output,
    and both paths were taken."""
    from specbatch.stack.in_process import start_local_stack

    options = {"captured_steps": "static", "max_sequences": 8, "max_context": 128}
    stack = start_local_stack(target_model, eagle_draft, tokenizer, max_batch_size=8, max_new_tokens=64,
                              target_engine_options=options, draft_engine_options=options)
    try:
        outputs = {k: [r.token_ids for r in greedy_mixed_batch(stack, seed=13, k=k)] for k in (0, 3)}
        assert outputs[3] == outputs[0]
        assert outputs[0] == [greedy_reference(target_model, p, 30) for p in random_prompts(13)]
        assert stack.target_engines[0].forward.replayed > 10 and stack.draft_engines[0].forward.replayed > 10
    finally:
        stack.stop()


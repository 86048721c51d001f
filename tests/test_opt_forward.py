"""The engine's own forward for OPT (specbatch.models.opt) against transformers' OPTForCausalLM: the same
logits over ragged batches (cached prefixes, a rollback, a decode step, non-adjacent slots), the
same greedy decoding as ``generate``, and bf16 close to the transformers path."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_engine import Decoding, random_prompts, verify_steps
from tiny import greedy_reference, tiny_opt

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.models.opt import OptForward

SHAPES = {
    "pre-norm": {},
    "projected-tied": dict(word_embed_proj_dim=32, tie_word_embeddings=True),  # project_in / project_out
    "post-norm": dict(do_layer_norm_before=False, word_embed_proj_dim=48),  # opt-350m's layout
}


@pytest.fixture(scope="module", params=list(SHAPES))
def opt_model(request):
    return tiny_opt(layers=2, seed=3, **SHAPES[request.param])


def run_calls(engine: Engine) -> list[torch.Tensor]:
    """A fixed script of ragged calls; the logits of every fed token of every call, in order."""
    prompts = random_prompts([3, 9, 17], seed=2)
    out = []

    def call(items: list[SequenceInput], decode_tokens: list[int] | None = None):
        batch = engine.start(items, decode_steps=1 if decode_tokens else 0, create=True)
        logits = batch.prefill(int(batch.fed.max()))
        out.extend(logits[i, logits.shape[1] - len(item.tokens):] for i, item in enumerate(items))
        if decode_tokens:
            out.append(batch.decode(torch.tensor(decode_tokens)))
        batch.commit([len(item.tokens) + bool(decode_tokens) for item in items])

    call([SequenceInput("a", 0, prompts[0][:1]), SequenceInput("b", 0, prompts[1][:6]),
          SequenceInput("c", 0, prompts[2])])
    # Each row its own count of new tokens over its cached prefix, then one decode step.
    call([SequenceInput("a", 1, prompts[0][1:]), SequenceInput("b", 6, prompts[1][6:]),
          SequenceInput("c", 17, [40])], decode_tokens=[7, 8, 9])
    engine.rollback("c", 10)  # the columns past 10 are stale now
    call([SequenceInput("c", 10, [11, 12, 13, 14]), SequenceInput("a", 4, [50, 51])])  # slots 2 and 0
    call([SequenceInput("b", 5, [60]), SequenceInput("c", 14, [61, 62])])  # a rollback through keep_len
    return out


def test_auto_picks_the_own_forward_for_opt(opt_model):
    engine = Engine(opt_model)
    assert engine.implementation == "specbatch" and isinstance(engine.forward, OptForward)
    ids = torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="target features"):  # OPT is never the EAGLE-style draft
        engine.forward(ids, ids, ids, None, torch.ones(1, 1, 1, 1, dtype=torch.bool), 1, torch.zeros(1, 1, 8))


def test_logits_match_transformers_over_ragged_calls(opt_model):
    own = run_calls(Engine(opt_model, implementation="specbatch"))
    reference = run_calls(Engine(opt_model, implementation="transformers"))
    assert len(own) == len(reference) == 11
    for mine, theirs in zip(own, reference):
        assert mine.shape == theirs.shape
        assert torch.allclose(mine, theirs, atol=1e-4), (mine - theirs).abs().max()


def test_greedy_verify_matches_generate(opt_model):
    engine = Engine(opt_model, implementation="specbatch")
    prompts = random_prompts([2, 7, 16, 5], seed=1)
    new_tokens = [14, 18, 10, 16]
    refs = [greedy_reference(opt_model, p, n) for p, n in zip(prompts, new_tokens)]
    prefilled = [1, 5, 15]
    engine.prefill([SequenceInput(f"s{i}", 0, prompts[i][:m]) for i, m in enumerate(prefilled)])
    decodings = [Decoding(f"s{i}", prompts[i], refs[i], prefilled[i] if i < 3 else 0) for i in range(4)]
    seen = verify_steps(engine, decodings, random.Random(7), create_first=True)
    assert seen["full_accept"] > 0 and seen["reject"] > 0


def test_bf16_agrees_with_transformers_in_argmax(opt_model):
    model = copy.deepcopy(opt_model).to(torch.bfloat16)
    own = torch.cat([row.reshape(-1, row.shape[-1]) for row in run_calls(Engine(model, implementation="specbatch"))])
    reference = torch.cat([row.reshape(-1, row.shape[-1])
                           for row in run_calls(Engine(model, implementation="transformers"))])
    assert bool(torch.isfinite(own).all())
    agree = (own.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree

"""Keys and values kept in bfloat16 (``Engine(kv_bf16=True)``, the services' ``--kv-bf16``): the
kernels write them rounded to nearest even and read them widened back, so attention over them is
attention over float32 tensors holding the rounded values, bit for bit; rows stay independent of
each other, so speculation stays exact against target-only decoding with the same setting."""

from __future__ import annotations

import pytest
import torch

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.kernels import build
from specbatch.kernels.layers import HEAD_DIMS, KV_DTYPES, Attention, Rope
from specbatch.models.llama import _signed_sin
from tests.tiny import greedy_mixed_batch, tiny_llama, with_threads

pytestmark = pytest.mark.skipif(not build.available(), reason=f"no CPU kernels here: {build.unavailable_reason()}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [4, 20])
def test_attention_over_bf16_keys_is_attention_over_their_float32_values(head_dim, threads, width):
    """Every head size (the AVX2 and the 512-bit rows), a strided pool slice, a mask with hidden
    columns, a step's few rows (each key widened where it is read) and a prefill's many (widened
    once per key/value head first): the outputs are bitwise those of the float32 kernel on the
    widened keys and values."""
    generator = torch.Generator().manual_seed(head_dim)
    batch, end = 3, 75
    q = (torch.randn(batch, width, 9, head_dim, generator=generator) * 2).transpose(1, 2)
    pool = (torch.randn(2, batch + 1, 3, end + 5, head_dim, generator=generator) * 4).bfloat16()
    keys, values = pool[0, 1:, :, :end], pool[1, 1:, :, :end]
    mask = torch.rand(batch, 1, width, end, generator=generator) < 0.8
    mask[..., 0] = True
    attention = Attention(mask)
    ours = with_threads(threads, lambda: attention(q, keys, values, head_dim**-0.5))
    widened = pool.float()
    theirs = attention(q, widened[0, 1:, :, :end], widened[1, 1:, :, :end], head_dim**-0.5)
    assert torch.equal(ours, theirs)


def test_attention_refuses_mixed_or_other_dtypes():
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    q = torch.randn(1, 3, 1, 16)
    keys = torch.randn(1, 1, 6, 16)
    attention = Attention(mask)
    with pytest.raises(ValueError, match="bfloat16"):
        attention(q, keys.bfloat16(), keys, 0.25)
    with pytest.raises(ValueError, match="bfloat16"):
        attention(q, keys.half(), keys.half(), 0.25)
    with pytest.raises(ValueError, match="bfloat16"):
        attention(q.bfloat16(), keys.bfloat16(), keys.bfloat16(), 0.25)


@pytest.mark.parametrize("threads", [1, 2])
def test_rope_writes_keys_and_values_rounded_as_torch_rounds_them(threads):
    """The write rounds as ``.to(torch.bfloat16)`` does, ties to even, NaN, infinities, overflow and
    subnormals included: with zero angles (cos 1, sin 0) the rotated keys are the inputs."""
    heads, kv_heads, head_dim, width = 2, 2, 16, 40
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, width, (heads + 2 * kv_heads) * head_dim, generator=generator) * 30
    edge = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-8 * (1 + 2**-8), float("nan"), float("inf"),
                         -float("inf"), 3.4e38, -3.4e38, 1e-40, -0.0, 0.0, 65504.0, 1 + 2**-9, 1 + 2**-8 + 2**-20, 7.0])
    qkv[0, 0, heads * head_dim : heads * head_dim + 16] = edge  # the first token's first key head
    positions = torch.arange(width)[None]
    cos, sin = torch.ones(width, head_dim), torch.zeros(width, head_dim)
    pools = {dtype: torch.zeros(2, 1, kv_heads, width + 1, head_dim, dtype=dtype) for dtype in KV_DTYPES}
    for dtype, pool in pools.items():
        rope = Rope(positions, positions, cos, _signed_sin(sin).contiguous())
        with_threads(threads, lambda: rope(qkv.clone(), heads, kv_heads, pool[0], pool[1]))
    rounded = pools[torch.float32].bfloat16()
    written = pools[torch.bfloat16]
    assert torch.equal(written.view(torch.int16)[~written.isnan()], rounded.view(torch.int16)[~rounded.isnan()])
    # (an infinity times sin 0 makes its rotation partner NaN too)
    assert torch.equal(written.isnan(), rounded.isnan()) and written.isnan().any()


@pytest.mark.parametrize("form", [pytest.param({}, id="float32"),
                                  pytest.param({"weights": "bf16"}, id="bf16-weights"),
                                  pytest.param({"weights": "bf16-dot"}, id="bf16-dot", marks=pytest.mark.skipif(
                                      not build.bf16_dot_available(), reason="the CPU lacks AVX512_BF16"))])
def test_the_engine_keeps_bf16_keys_and_values_near_its_float32_ones(form):
    """The pool holds bfloat16, the layers in one call are bitwise the Python loop over it, and the
    logits of a prompt and a step stay within bf16 rounding of the float32 pool's."""
    engines = {kv: Engine(tiny_llama(3, seed=5), max_sequences=2, kv_bf16=kv, **form) for kv in (False, True)}
    assert engines[True].pool.kv.dtype == torch.bfloat16 and engines[False].pool.kv.dtype == torch.float32

    def logits(engine: Engine) -> list[torch.Tensor]:
        prompt = list(range(3, 40))
        batch = engine.start([SequenceInput("a", 0, prompt), SequenceInput("b", 0, prompt[:7])], create=True)
        outputs = [batch.prefill(2)]
        batch.commit([len(prompt), 7])
        step = engine.start([SequenceInput("a", len(prompt), [5, 6, 7]), SequenceInput("b", 7, [9])])
        outputs.append(step.prefill(3))
        engine.release(["a", "b"])
        return outputs

    bf16 = engines[True]
    one_call = logits(bf16)
    layers, bf16.forward.decoder_layers = bf16.forward.decoder_layers, None
    assert layers is not None
    for ours, loop in zip(one_call, logits(bf16), strict=True):
        assert torch.equal(ours, loop)
    for ours, theirs in zip(one_call, logits(engines[False]), strict=True):
        assert not torch.equal(ours, theirs)
        torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)


def test_a_kv_budget_holds_twice_the_sequences_in_bf16():
    sizes = {kv: Engine(tiny_llama(1, seed=0), max_sequences=4, kv_bf16=kv).pool for kv in (False, True)}
    assert sizes[False].bytes_for(4, 100) == 2 * sizes[True].bytes_for(4, 100)


def test_bf16_keys_and_values_are_refused_off_the_cpu_kernels(monkeypatch):
    with pytest.raises(ValueError, match="bf16 keys and values"):
        Engine(tiny_llama(1, seed=0).to(torch.bfloat16), kv_bf16=True)
    with pytest.raises(ValueError, match="bf16 keys and values"):
        Engine(tiny_llama(1, seed=0), implementation="transformers", kv_bf16=True)
    with pytest.raises(ValueError, match="captured steps"):
        Engine(tiny_llama(1, seed=0), captured_steps="static", kv_bf16=True)
    monkeypatch.setattr(build, "available", lambda: False)
    with pytest.raises(ValueError, match="bf16 keys and values"):
        Engine(tiny_llama(1, seed=0), kv_bf16=True)


def test_speculation_with_bf16_keys_and_values_is_its_own_target_only_decoding(target_model, draft_model, tokenizer):
    """Target and draft keep bf16 keys and values: greedy output at k = 3, with leaves, in one mixed
    batch, is token for token the same stack's target-only (k = 0) output."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=64,
                              target_engine_options={"kv_bf16": True}, draft_engine_options={"kv_bf16": True})
    try:
        assert stack.target_engines[0].pool.kv.dtype == torch.bfloat16
        assert stack.draft_engines[0].pool.kv.dtype == torch.bfloat16
        speculative = greedy_mixed_batch(stack, seed=12, k=3)
        assert sum(r.stats.draft_tokens_accepted for r in speculative) > 0
        assert [r.token_ids for r in speculative] == [r.token_ids for r in greedy_mixed_batch(stack, seed=12, k=0)]
    finally:
        stack.stop()

"""The engine's own float32 kernels (specbatch.kernels.build): the product and attention, and a row's bits
independent of the other rows of the call and of the thread count, which bitwise-exact fp32
speculation needs."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.kernels import build, cpu
from specbatch.kernels.layers import HEAD_DIMS, Attention, Rope, add_rms_norm, argmax, argmax_list, silu_mul
from specbatch.kernels.linear import fused, linear
from specbatch.kernels.panel import PanelLinear
from tests.tiny import VOCAB, tiny_llama
from tests.tiny import with_threads as _with_threads

pytestmark = pytest.mark.skipif(not build.available(), reason=f"no panel kernel here: {build.unavailable_reason()}")

# Shapes with a partial last panel (N % 16), odd K, SmolLM2's MLP and a head-sized slice.
SHAPES = [(17, 5), (96, 64), (40, 33), (3072, 576), (576, 1536), (4099, 576)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_is_the_product(out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    layer = PanelLinear(weight, bias)
    x = torch.randn(2, 7, in_features, generator=generator)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    out = layer(x)
    assert out.shape == (2, 7, out_features) and out.dtype == torch.float32
    # float32 sums of in_features terms: within a few ulps of the float64 product's magnitude
    bound = 1e-6 * in_features * (x.double().abs() @ weight.double().abs().T + 1)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(40, 33), (960, 576), (576, 1536)])
def test_a_row_gets_the_same_bits_at_any_row_count_and_thread_count(out_features, in_features, threads):
    """Each row is summed in one fixed order (k = 0 .. K-1, one FMA a term) whatever the register
    block it lands in (1-6 rows; 7 rows split 4 + 3, 13 rows 5 + 4 + 4, ...) or which thread
    computes its panel."""
    generator = torch.Generator().manual_seed(3)
    layer = PanelLinear(torch.randn(out_features, in_features, generator=generator) * 0.05)
    x = torch.randn(40, in_features, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        torch.set_num_threads(threads)
        for rows in list(range(1, 15)) + [17, 25, 40]:
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_weights_are_the_float32_kernel_on_the_rounded_weights(out_features, in_features, threads):
    """A weight kept in bf16 and widened in registers multiplies exactly as its bf16-rounded float32
    copy does on the float32 kernel: the same bits at every row count (so row-exact too), with a
    bias, on any thread count."""
    generator = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    ours = PanelLinear(weight, bias, bf16_weights=True)
    rounded = PanelLinear(weight.bfloat16().float(), bias)
    assert ours.panels.dtype == torch.bfloat16 and ours.panels.shape == rounded.panels.shape
    x = torch.randn(40, in_features, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in list(range(1, 9)) + [13, 40]:
            assert torch.equal(ours(x[:rows]), rounded(x[:rows])), rows
    finally:
        torch.set_num_threads(before)


def rows_alone_and_beside_others(layer, x: torch.Tensor, threads: int, row_counts) -> torch.Tensor:
    """Each row of ``x`` through ``layer`` alone on one thread; asserts that the first n rows, for
    every n of ``row_counts``, give the same bits together on ``threads`` threads. Returns the rows
    computed alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        torch.set_num_threads(threads)
        for rows in row_counts:
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)
    return alone


def layer_and_rows(out_features: int, in_features: int, seed: int, **form):
    """A random weight and bias, the PanelLinear of them in ``form``, and 40 input rows."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    return weight, bias, PanelLinear(weight, bias, **form), torch.randn(40, in_features, generator=generator)


needs_bf16_dot = pytest.mark.skipif(not build.bf16_dot_available(), reason="the CPU lacks AVX512_BF16")


@needs_bf16_dot
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_dot_products_are_row_exact_products_of_the_rounded_operands(out_features, in_features, threads):
    """Weights and inputs rounded to bf16, pairs' products summed in float32: within float32
    rounding of the float64 product of the rounded operands (odd K's last pair padded with zero),
    and each row the same bits alone or beside others (1-12 rows one block, 13, 16, 17 and 40 rows
    split into blocks of at most 8), on any thread count."""
    weight, bias, layer, x = layer_and_rows(out_features, in_features, out_features * in_features + 1, bf16_dot=True)
    assert layer.panels.dtype == torch.bfloat16 and layer.bf16_dot and not layer.bf16_weights
    rounded_x, rounded_w = x.bfloat16().double(), weight.bfloat16().double()
    exact = rounded_x @ rounded_w.T + bias.double()
    bound = 1e-6 * in_features * (rounded_x.abs() @ rounded_w.abs().T + 1)
    alone = rows_alone_and_beside_others(layer, x, threads, list(range(1, 14)) + [16, 17, 40])
    assert ((alone.double() - exact).abs() <= bound).all()


needs_fp16 = pytest.mark.skipif(not build.fp16_dot_available(), reason="the CPU lacks AVX512_FP16")


needs_blocks = pytest.mark.skipif(not build.blocks_available(), reason="the GGUF block kernels did not build here")


@needs_fp16
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_float16_products_are_row_exact_and_closer_than_bf16(out_features, in_features, threads):
    """Weights and inputs rounded to float16, products summed in float16 in runs of 32: each row the
    same bits alone or beside others (1-24 rows a block; 25, 31 and 40 rows split), on any thread
    count; within the worst case of its roundings of the float64 product (each of a run's 32 adds
    rounds by at most 2^-11 of the run's sum of |terms|, the operands by 2^-11 each), and on average
    closer to it than bf16's 8 bits allow."""
    weight, bias, layer, x = layer_and_rows(out_features, in_features, out_features * in_features + 2, fp16_dot=True)
    assert layer.panels.dtype == torch.float16 and layer.fp16_dot and not layer.bf16_dot
    exact = x.double() @ weight.double().T + bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T
    alone = rows_alone_and_beside_others(layer, x, threads, list(range(1, 15)) + [17, 23, 24, 25, 31, 40])
    error = (alone.double() - exact).abs()
    assert (error <= 2**-5 * magnitude + 1e-6 * (exact.abs() + 1)).all()
    assert error.norm() <= 0.5 * ((x.bfloat16().double() @ weight.bfloat16().double().T + bias.double()) - exact).norm()


@needs_fp16
def test_float16_products_take_any_row_scale():
    """Each row is scaled by a power of two into float16's range first, so a row times 2^e gives
    the same result times 2^e, bit for bit, from rows of 1e-30 to 1e30 (no overflow to inf, no
    underflow to zero), and a zero row gives zeros."""
    generator = torch.Generator().manual_seed(5)
    layer = PanelLinear(torch.randn(96, 576, generator=generator) * 0.05, fp16_dot=True)
    x = torch.randn(3, 576, generator=generator)
    base = layer(x)
    for exponent in (-100, -20, 20, 100):
        assert torch.equal(layer(torch.ldexp(x, torch.tensor(exponent))), torch.ldexp(base, torch.tensor(exponent)))
    assert torch.isfinite(layer(x * 1e30)).all() and torch.equal(layer(torch.zeros(2, 576)), torch.zeros(2, 96))


@pytest.mark.parametrize("form, weights, available, flag", [
    ("bf16_dot", "bf16-dot", "bf16_dot_available", "AVX512_BF16"),
    ("fp16_dot", "fp16-dot", "fp16_dot_available", "AVX512_FP16"),
    ("q4_1", "q4_1", "blocks_available", "F16C")])
def test_dot_product_forms_are_refused_where_the_cpu_lacks_them(monkeypatch, form, weights, available, flag):
    weight = torch.randn(32, 16)
    monkeypatch.setattr(build, available, lambda: False)
    with pytest.raises(RuntimeError, match=flag):
        PanelLinear(weight, **{form: True})
    with pytest.raises(ValueError, match=flag):
        linear(weight, weights=weights)
    with pytest.raises(ValueError, match=flag):
        Engine(tiny_llama(1, seed=0), weights=weights)


def _attention_inputs(batch, width, end, head_dim, seed, heads=9, kv_heads=3):
    """q as the engine has it (a transposed view), keys/values as slices of a wider pool, a causal
    mask over the last ``width`` columns with one row's random columns hidden too."""
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, width, heads, head_dim, generator=generator) * 2).transpose(1, 2)
    pool = torch.randn(2, batch, kv_heads, end + 9, head_dim, generator=generator)
    keys, values = pool[0, :, :, :end], pool[1, :, :, :end]
    mask = torch.ones(batch, 1, width, end, dtype=torch.bool)
    mask[..., end - width :] = torch.ones(width, width, dtype=torch.bool).tril()
    mask[0, 0, 0] &= torch.rand(end, generator=generator) > 0.4
    mask[..., 0] = True
    return q, keys, values, mask


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("batch,width,end", [(1, 1, 1), (1, 3, 130), (3, 6, 37), (2, 16, 300)])
def test_attention_is_sdpa(batch, width, end, head_dim):
    q, keys, values, mask = _attention_inputs(batch, width, end, head_dim, seed=width + end)
    out = Attention(mask)(q, keys, values, head_dim**-0.5)
    exact = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask,
                                           scale=head_dim**-0.5, enable_gqa=True)
    assert out.shape == (batch, width, 9 * head_dim)
    torch.testing.assert_close(out.double(), exact.transpose(1, 2).reshape(batch, width, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 3), (8, 2), (10, 2), (16, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_takes_any_number_of_heads_a_key_value_head(heads, kv_heads, threads):
    """Query heads per key/value head from 1 to 8 (the 512-bit kernels sum up to four heads' values
    side by side, more in runs of four): SDPA's results, and each head's row alone gets the same
    bits as beside its group's other heads and rows."""
    generator = torch.Generator().manual_seed(heads)
    batch, width, end, head_dim = 2, 5, 40, 64
    q = torch.randn(batch, width, heads, head_dim, generator=generator).transpose(1, 2)
    keys, values = torch.randn(2, batch, kv_heads, end, head_dim, generator=generator)
    mask = torch.ones(batch, 1, width, end, dtype=torch.bool)
    mask[..., end - width:] = torch.ones(width, width, dtype=torch.bool).tril()
    mask[1, 0, 2, :7] = False
    out = _with_threads(threads, lambda: Attention(mask)(q, keys, values, 0.125))
    exact = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=mask, scale=0.125,
                                           enable_gqa=True)
    torch.testing.assert_close(out.double(), exact.transpose(1, 2).reshape(batch, width, -1), rtol=1e-5, atol=1e-5)
    group = heads // kv_heads
    for head in (0, group - 1, heads - 1):  # one head alone: a query head per key/value head
        one = Attention(mask[:, :, 3:4])(q[:, head : head + 1, 3:4], keys[:, head // group : head // group + 1],
                                                 values[:, head // group : head // group + 1], 0.125)
        assert torch.equal(one[:, 0], out[:, 3, head * head_dim : (head + 1) * head_dim]), head


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_rows_get_the_same_bits_alone_and_at_any_thread_count(threads):
    """A query row's output depends only on its query and the columns it sees, summed in column
    order: alone, beside other rows, or with its columns further right past hidden ones (a leaf's
    keys/values sit past the chain it does not see), at any thread count."""
    q, keys, values, mask = _attention_inputs(2, 7, 90, 64, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = Attention(mask)(q, keys, values, 0.125)
        for row in range(7):
            alone = Attention(mask[:, :, row : row + 1])(q[:, :, row : row + 1], keys, values, 0.125)
            assert torch.equal(alone[:, 0], together[:, row]), row
        # the last row again, its keys/values three columns right with hidden columns between
        moved_keys, moved_values = torch.zeros(2, 3, 93, 64), torch.zeros(2, 3, 93, 64)
        moved_keys[:, :, :89], moved_values[:, :, :89] = keys[:, :, :89], values[:, :, :89]
        moved_keys[:, :, 92], moved_values[:, :, 92] = keys[:, :, 89], values[:, :, 89]
        moved_mask = torch.zeros(2, 1, 1, 93, dtype=torch.bool)
        moved_mask[..., :89], moved_mask[..., 92] = mask[:, :, 6:, :89], True
        moved = Attention(moved_mask)(q[:, :, 6:], moved_keys, moved_values, 0.125)
        assert torch.equal(moved[:, 0], together[:, 6])
    finally:
        torch.set_num_threads(before)


def test_attention_refuses_what_does_not_match_its_mask():
    q, keys, values, mask = _attention_inputs(1, 2, 10, 16, seed=1)
    attend = Attention(mask)
    with pytest.raises(ValueError):
        attend(q, keys[:, :, :9], values[:, :, :9], 0.25)
    with pytest.raises(ValueError):
        attend(q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, 0.25)


def test_the_engine_attends_natively_in_float32_with_sdpas_results():
    """The own forward attends on the kernel in float32, prompts included; its logits are SDPA's
    within float32 rounding."""
    engine = Engine(tiny_llama(2, seed=0), max_sequences=2)
    assert engine.forward.native_attention
    prompt = list(range(3, 40))

    def logits(native_attention: bool) -> torch.Tensor:
        engine.forward.native_attention = native_attention
        batch = engine.start([SequenceInput("a", 0, prompt)], create=True)
        first = batch.prefill(1)
        batch.commit([len(prompt)])
        step = engine.start([SequenceInput("a", len(prompt), [5, 6, 7])])
        logits = torch.cat([first.reshape(-1), step.prefill(3).reshape(-1)])
        engine.release(["a"])
        return logits

    torch.testing.assert_close(logits(True), logits(False), rtol=1e-4, atol=1e-4)
    assert not Engine(tiny_llama(1, seed=0).to(torch.bfloat16)).forward.native_attention


@pytest.mark.parametrize("other_length", [5, 30, 90])
def test_a_prompt_prefills_to_the_same_bits_alone_or_beside_a_longer_one(other_length):
    """In float32 a prompt's logits must not depend on what else a call prefills (the coordinator
    batches prompts; the reference decodes each alone): with SDPA for prompts, a 20-token prompt
    beside a longer one, or a 12-token one beside one of more than 16 tokens, moved the real
    model's logits by up to 0.15."""
    engine = Engine(tiny_llama(2, seed=3), max_sequences=2)
    generator = torch.Generator().manual_seed(other_length)
    prompt = torch.randint(3, VOCAB, (20,), generator=generator).tolist()
    other = torch.randint(3, VOCAB, (other_length,), generator=generator).tolist()

    def last_logits(*prompts) -> torch.Tensor:
        names = [f"p{i}" for i in range(len(prompts))]
        batch = engine.start([SequenceInput(name, 0, p) for name, p in zip(names, prompts)], create=True)
        logits = batch.prefill(1)[0, -1]
        engine.release(names)
        return logits

    assert torch.equal(last_logits(prompt), last_logits(prompt, other))
    assert torch.equal(last_logits(prompt[:12]), last_logits(prompt[:12], other))


# ---- the decoder's layers in one call (decoder.c) ------------------------------------------------------

FORMS = [pytest.param({}, id="float32"), pytest.param({"weights": "bf16"}, id="bf16-weights"),
         pytest.param({"weights": "bf16-dot"}, id="bf16-dot", marks=needs_bf16_dot),
         pytest.param({"weights": "fp16-dot"}, id="fp16-dot", marks=needs_fp16),
         pytest.param({"weights": "q8_0"}, id="q8_0", marks=needs_blocks),
         pytest.param({"weights": "q4_1"}, id="q4_1", marks=needs_bf16_dot)]


def _prompts_then_a_ragged_step(engine: Engine) -> list[torch.Tensor]:
    """Two prompts prefilled together (37 and 7 tokens), then a step feeding 3 and 1 tokens: the
    logits and final hidden states of both calls."""
    prompt = list(range(3, 40))
    batch = engine.start([SequenceInput("a", 0, prompt), SequenceInput("b", 0, prompt[:7])], create=True)
    outputs = [batch.prefill(2), batch.last_hidden()]
    batch.commit([len(prompt), 7])
    step = engine.start([SequenceInput("a", len(prompt), [5, 6, 7]), SequenceInput("b", 7, [9])])
    outputs += [step.prefill(3), step.last_hidden()]
    engine.release(["a", "b"])
    return outputs


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_layers_in_one_call_are_bitwise_the_python_loop(form, threads):
    """decoder.c runs the layer loop's kernels in its order with its arguments: logits, hidden
    states are the loop's bit for bit, for prompts and for a ragged step that reads the keys and
    values they wrote."""
    engine = Engine(tiny_llama(3, seed=5), max_sequences=2, **form)
    layers = engine.forward.decoder_layers
    assert layers is not None

    def run(one_call: bool) -> list[torch.Tensor]:
        engine.forward.decoder_layers = layers if one_call else None
        return _with_threads(threads, lambda: _prompts_then_a_ragged_step(engine))

    for ours, theirs in zip(run(True), run(False), strict=True):
        assert torch.equal(ours, theirs)


def test_wide_calls_run_on_more_threads_with_the_same_bits():
    """Engine(wide_threads=2, wide_from_rows=R): a call of at least R rows runs its layers and head
    on 2 threads, smaller ones on the process's count; the kernels' results do not depend on the
    thread count, so the outputs are the narrow engine's bit for bit."""
    narrow = Engine(tiny_llama(3, seed=7), max_sequences=2, weights="bf16")
    wide = Engine(tiny_llama(3, seed=7), max_sequences=2, weights="bf16", wide_threads=2, wide_from_rows=8)
    layers, threads_seen = wide.forward.decoder_layers, []

    def recording(*args):
        threads_seen.append(args[-1])
        return layers(*args)

    wide.forward.decoder_layers = recording
    ours = _with_threads(1, lambda: _prompts_then_a_ragged_step(wide))
    assert threads_seen == [2, 1]  # the prompts: 2 rows x 37 columns; the step: 2 x 3
    for mine, theirs in zip(ours, _with_threads(1, lambda: _prompts_then_a_ragged_step(narrow)), strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="wide_threads"):
        Engine(tiny_llama(1, seed=0), wide_threads=-1)


def test_the_layers_in_one_call_refuse_a_pool_that_does_not_match():
    engine = Engine(tiny_llama(2, seed=6), max_sequences=2)
    forward = engine.forward
    positions = torch.tensor([[4]])
    rope = Rope(positions, positions, *forward._angle_table(4))
    attention = Attention(torch.ones(1, 1, 1, 5, dtype=torch.bool))
    x = torch.randn(1, 1, engine.hidden_size)
    kv = torch.zeros(2, 2, 1, 2, 8, 16)  # 2 layers, 2 key/value heads of 16, 8 columns: the tiny model's
    assert forward.decoder_layers.kv_heads == 2 and forward.decoder_layers.head_dim == 16
    forward.decoder_layers(x.clone(), rope, attention, kv)  # fits
    for wrong in (kv[:1], kv[:, :, :, :1], kv[..., :4], kv.transpose(4, 5), kv[:, :, :, :, :3]):
        with pytest.raises(ValueError, match="decoder layers"):
            forward.decoder_layers(x.clone(), rope, attention, wrong)


def _drafting(engine: Engine, k: int, sampled: bool = False, leaves: list[int] = ()) -> list:
    """Three sequences' prompts, then three proposal calls of ``k`` feeding 2, 1 and 3 tokens (the
    draft's own at one call, those after a verdict at the next): the proposals, and each
    sequence's keys and values at the end."""
    from draft_service.proposer import ProposeItem, proposals
    from specbatch.engine.sampling import SamplingParams

    width = engine.feature_size
    g = torch.Generator().manual_seed(k)
    features = [torch.randn(60, width, generator=g) * 4 if width else None for _ in range(3)]

    def seq(i: int, start: int, stop: int) -> SequenceInput:
        tokens = [(7 * j + 3 * i) % VOCAB for j in range(start, stop)]
        return SequenceInput(f"s{i}", start, tokens, None if not width else features[i][start:stop])

    sampling = SamplingParams(temperature=0.8, seed=3) if sampled else SamplingParams()
    out = [proposals(engine, [ProposeItem(seq(i, 0, 20 + 5 * i), 1) for i in range(3)])]
    lengths = [20 + 5 * i for i in range(3)]
    for fed in ([2, 1, 3], [1, 1, 1], [3, 2, 1]):
        items = [ProposeItem(seq(i, lengths[i], lengths[i] + n), k, sampling if i == 1 else SamplingParams(),
                             list(leaves)) for i, n in enumerate(fed)]
        out.append(proposals(engine, items))
        lengths = [engine.sequences[f"s{i}"].length for i in range(3)]
    out += [engine.pool.kv[:, :, engine.sequences[f"s{i}"].slot, :, :lengths[i]].clone() for i in range(3)]
    engine.release([f"s{i}" for i in range(3)])
    return out


@pytest.mark.parametrize("form", FORMS[:2] + FORMS[4:5])
@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "plain"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_greedy_proposal_in_one_call_is_bitwise_the_loop(form, eagle, threads):
    """decoder.c's draft_chain drafts k tokens a row in one call, as the proposal's loop does a
    forward at a time: the same tokens and leaves at the first position, and the same keys and
    values left in the draft's cache (an EAGLE draft's fused features included), for ragged calls
    at every k; on more threads."""
    from specbatch.engine.batch import RaggedBatch
    from specbatch.models.eagle import draft_from_target

    model = tiny_llama(2, seed=11)
    if eagle:
        model = draft_from_target(model, num_layers=1, token_subset=torch.arange(VOCAB - 1, -1, -2)).float()
        with torch.no_grad():  # a fusing layer that is not the identity it starts as
            model.model.fc.weight.normal_(0.0, 0.2)
    engine = Engine(model, max_sequences=4, wide_threads=2 if threads == 2 else 0, **form)
    assert engine.forward.chains_natively()
    chained, calls = RaggedBatch.greedy_chain, []

    def counted(self, steps, to_token, first_logits=False):
        calls.append(steps)
        return chained(self, steps, to_token, first_logits)

    for k, leaves in ((1, []), (2, [2]), (4, []), (4, [3])):
        try:
            RaggedBatch.greedy_chain = counted
            ours = _with_threads(threads, lambda k=k, leaves=leaves: _drafting(engine, k, leaves=leaves))
            RaggedBatch.greedy_chain = lambda self, steps, to_token, first_logits=False: None  # the loop
            theirs = _with_threads(threads, lambda k=k, leaves=leaves: _drafting(engine, k, leaves=leaves))
        finally:
            RaggedBatch.greedy_chain = chained
        assert [(p.tokens, p.leaves) for call in ours[:4] for p in call] == \
            [(p.tokens, p.leaves) for call in theirs[:4] for p in call]
        for mine, loop in zip(ours[4:], theirs[4:], strict=True):
            assert torch.equal(mine, loop)
        assert len({tuple(p.tokens) for call in ours[1:4] for p in call}) > 3  # not one token over and over
        assert all(len(p.leaves[0]) == leaves[0] for call in ours[1:4] for p in call) if leaves else True
    assert calls.count(3) == 6 and calls.count(1) == 3  # every call at k = 4 and at k = 2 went through it


def test_host_indices_are_the_tensors_layout():
    """HostIndices, built in Python for the CPU kernels, hold what ``right_aligned`` and
    ``write_columns_and_mask`` build as tensors: token ids, positions, write columns (padding at
    the scratch column) and the mask, row-major."""
    import random

    from specbatch.engine.batch import HostIndices, right_aligned
    from specbatch.engine.kv_pool import write_columns_and_mask

    rng = random.Random(4)
    for _ in range(30):
        rows = rng.randint(1, 5)
        fed = [rng.randint(1, 6) for _ in range(rows)]
        kept = [rng.choice([0, 1, rng.randint(0, 40)]) for _ in range(rows)]
        tokens = [[rng.randint(1, VOCAB - 1) for _ in range(n)] for n in fed]
        width, scratch = max(fed), 99
        host = HostIndices(kept, fed, tokens, scratch)
        valid, positions, ids = right_aligned(kept, fed, width, tokens)
        end = int(positions[valid].max()) + 1
        columns, mask = write_columns_and_mask(positions, valid, scratch, end)
        assert (host.batch, host.width, host.end) == (rows, width, end)
        assert host.ends == [k + n for k, n in zip(kept, fed)]
        assert list(host.ids) == ids.flatten().tolist() and list(host.positions) == positions.flatten().tolist()
        assert list(host.columns) == columns.flatten().tolist()
        assert bytes(host.seen) == mask.to(torch.uint8).numpy().tobytes()


def _served_calls(engine: Engine) -> list:
    """A target's calls as a server makes them: prompts of three lengths, one alone; then verify
    calls (features returned) over gathered slots, out of slot order, with padded rows, alone and
    as a tree: every logit, hidden state, verdict and feature, and each sequence's keys and values."""
    from target_service.verifier import VerifyItem, verify

    prompts = {"a": list(range(3, 40)), "b": list(range(50, 57)), "c": list(range(60, 81))}
    out = _prompts_then_a_ragged_step(engine)
    alone = engine.start([SequenceInput("a", 0, prompts["a"])], create=True)
    out += [alone.prefill(1), alone.last_hidden()]  # one row, its last column: the head reads it in place
    alone.commit([len(prompts["a"])])
    engine.prefill([SequenceInput(s, 0 if s != "a" else len(prompts["a"]), prompts[s] if s != "a" else [4])
                    for s in ("a", "b", "c")])
    steps = [([("a", [5, 6]), ("c", [])], None), ([("c", [7, 8, 9]), ("a", [10])], None), ([("b", [11])], None),
             ([("b", [12, 13])], [[14, 15], []])]
    for step, leaves in steps:
        items = [VerifyItem(SequenceInput(s, engine.sequences[s].length, [2 + len(drafts)]), drafts,
                            leaves=leaves or []) for s, drafts in step]
        for verdict in verify(engine, items, return_features=True):
            out += [(verdict.accepted, verdict.next_token, verdict.cached_len, verdict.leaf), verdict.features]
    out += [engine.sequences[s].kv[:, :, :, : engine.sequences[s].length].clone() for s in ("a", "b", "c")]
    engine.release(["a", "b", "c"])
    return out


@pytest.mark.parametrize("form", FORMS[:2] + FORMS[4:5])
def test_host_built_calls_are_bitwise_the_tensor_built_ones(monkeypatch, form):
    """A chain call on the CPU kernels takes its inputs as HostIndices (plain Python buffers, the
    embedding copied by rows, the head reading the kept columns in place, argmax into Python
    ints): the outputs, keys and values of the same calls built as tensors, bit for bit; for a
    target's prompts and verify steps (against the Python layer loop), and a draft's proposals
    (EAGLE: fed features; against its loop of forwards)."""
    from specbatch.engine.batch import RaggedBatch
    from specbatch.models.eagle import draft_from_target
    from specbatch.models.llama import LlamaForward

    target = Engine(tiny_llama(2, seed=21), max_sequences=4, **form)
    draft_model = draft_from_target(tiny_llama(2, seed=22), num_layers=1,
                                    token_subset=torch.arange(VOCAB - 1, -1, -2)).float()
    with torch.no_grad():
        draft_model.model.fc.weight.normal_(0.0, 0.2)
    draft = Engine(draft_model, max_sequences=4, **form)
    built = []
    original = RaggedBatch.__init__

    def noting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self.host is not None)

    monkeypatch.setattr(RaggedBatch, "__init__", noting)
    ours = [_served_calls(target)] + [_drafting(draft, k) for k in (1, 3)]
    assert built.count(False) == 1  # the tree's call alone takes tensors
    monkeypatch.setattr(LlamaForward, "reads_host_indices", lambda self: False)
    target.forward.decoder_layers = None  # and the target's layers as the Python loop, its head on a slice
    built.clear()
    theirs = [_served_calls(target)] + [_drafting(draft, k) for k in (1, 3)]
    assert not any(built)
    for mine, tensors in zip(ours, theirs, strict=True):
        for a, b in zip(mine, tensors, strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_one_call_proposal_refuses_what_does_not_match():
    """draft_chain's arguments are checked before C reads them: drafted tokens past the pool's
    columns, a token map of another dtype or size, token ids of another dtype, positions for
    another batch."""
    engine = Engine(tiny_llama(2, seed=13), max_sequences=2)
    forward, layers = engine.forward, engine.forward.decoder_layers
    positions = torch.tensor([[3, 4]])
    rope = Rope(positions, positions, *forward._angle_table(40))
    attention = Attention(torch.ones(1, 1, 2, 5, dtype=torch.bool))
    kv = torch.zeros(2, 2, 1, 2, 8, 16)  # 8 columns: the last is scratch
    ids = array("q", [5, 6])

    def chain(**changed):
        arguments = {"embed": forward.embed, "fuse": None, "input_ids": ids, "features": None, "rope": rope,
                     "attention": attention, "kv": kv, "next_positions": [5], "steps": 2, "head": forward.head,
                     "to_token": None, **changed}
        return layers.draft_chain(**arguments)

    assert [len(row) for row in chain()[0]] == [3]  # fits: positions 5 and 6, below the scratch column 7
    for wrong in ({"steps": 3}, {"to_token": torch.arange(VOCAB, dtype=torch.int32)},
                  {"to_token": torch.arange(VOCAB - 1)}, {"input_ids": array("i", [5, 6])}, {"next_positions": [5, 5]}):
        with pytest.raises(ValueError, match="draft chain"):
            chain(**wrong)


def test_sampled_rows_and_later_leaves_draft_forward_by_forward():
    """A proposal with a sampled row, or with leaves asked past the first position, takes the loop
    (it needs those positions' distributions or rankings)."""
    from specbatch.engine.batch import RaggedBatch

    engine = Engine(tiny_llama(2, seed=12), max_sequences=4)
    chained, calls = RaggedBatch.greedy_chain, []
    RaggedBatch.greedy_chain = lambda self, steps, *rest: calls.append(steps) or chained(self, steps, *rest)
    try:
        _drafting(engine, 3, sampled=True)
        _drafting(engine, 3, leaves=[0, 2])
        _drafting(engine, 3, leaves=[2])
    finally:
        RaggedBatch.greedy_chain = chained
    assert calls == [0, 0, 0, 2, 2, 2]  # each run's prompts (greedy, k = 1), then the last run's calls


def test_projections_off_the_panel_kernel_keep_the_python_loop():
    """bf16 on oneDNN is not the kernels'."""
    assert Engine(tiny_llama(1, seed=0).to(torch.bfloat16)).forward.decoder_layers is None


# ---- a layer's small operations (layer_ops.c) ---------------------------------------------------------

@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (5, 37), (300, 576)])
def test_add_rms_norm_adds_in_place_and_normalises(rows, n):
    generator = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=generator) * 3
    delta = torch.randn(rows, n, generator=generator)
    weight = torch.randn(n, generator=generator)
    summed = x + delta
    out = add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, summed)  # the residual stream, updated in place: the same float adds
    exact = weight.double() * summed.double() * torch.rsqrt(summed.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), exact, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(add_rms_norm(x, None, weight, 1e-5), out, rtol=0, atol=0)  # no add


@pytest.mark.parametrize("rows,n", [(1, 1536), (4, 21), (200, 1536)])
def test_silu_mul_is_the_gated_product(rows, n):
    generator = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * n, generator=generator) * 6
    h[0, :4] = torch.tensor([-100.0, 100.0, -0.0, 1e-30])  # exp's ends: no overflow, no NaN
    out = silu_mul(h)
    exact = F.silu(h[:, :n].double()) * h[:, n:].double()
    torch.testing.assert_close(out.double(), exact, rtol=4e-7, atol=1e-30)


def _rope_inputs(batch, width, heads, kv_heads, head_dim, columns_in_pool, seed):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, width, (heads + 2 * kv_heads) * head_dim, generator=generator)
    positions = torch.randint(0, 500, (batch, width), generator=generator)
    columns = torch.stack([torch.randperm(columns_in_pool, generator=generator)[:width] for _ in range(batch)])
    angles = torch.randn(500, head_dim, generator=generator)
    return qkv, positions, columns, angles.cos(), angles.sin()


@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("batch,width", [(1, 1), (3, 5), (2, 40)])
def test_rope_is_bitwise_the_pytorch_rotation_and_kv_write(batch, width, head_dim):
    """The rotated queries, and the keys and values written into the cache, bit for bit what the
    PyTorch operators compute (products rounded, then added: no fused multiply-add), into a
    gathered (non-contiguous) pool slice as the engine's batch has it."""
    from specbatch.models.llama import _signed_sin, _TorchRope

    heads, kv_heads = 6, 2
    qkv, positions, columns, cos, sin = _rope_inputs(batch, width, heads, kv_heads, head_dim, 60, seed=head_dim)
    pools = [torch.zeros(2, batch + 1, kv_heads, 61, head_dim) for _ in range(2)]
    caches = [pool[:, 1:] for pool in pools]  # [2, batch, kv_heads, columns, head_dim], strided
    theirs = _TorchRope(cos[positions], sin[positions], columns)(qkv.clone(), heads, kv_heads, *caches[0])
    ours = Rope(positions, columns, cos, _signed_sin(sin).contiguous())(qkv, heads, kv_heads, *caches[1])
    assert ours.shape == (batch, heads, width, head_dim)
    assert torch.equal(ours, theirs) and torch.equal(pools[1], pools[0])
    assert pools[1][:, 0].abs().sum() == 0  # nothing written outside the batch's slots


def test_rope_refuses_what_it_cannot_write():
    qkv, positions, columns, cos, sin = _rope_inputs(1, 2, 2, 1, 8, 10, seed=0)
    rope = Rope(positions, columns, cos, sin)
    cache = torch.zeros(2, 1, 1, 10, 8)
    with pytest.raises(ValueError):
        rope(qkv, 2, 1, cache[0, :, :, :5], cache[1, :, :, :5])  # a write column past the cache
    with pytest.raises(ValueError):
        rope(qkv[..., :-8], 2, 1, *cache)  # not the head counts' width
    with pytest.raises(ValueError):
        Rope(positions + 500, columns, cos, sin)  # a position without angles
    odd = torch.randn(500, 7)
    with pytest.raises(ValueError):
        Rope(positions, columns, odd, odd)(torch.randn(1, 2, 28), 2, 1, *torch.zeros(2, 1, 1, 10, 7))


@pytest.mark.parametrize("threads", [1, 2])
def test_layer_ops_give_a_row_the_same_bits_alone_and_at_any_thread_count(threads):
    """Rows large enough for a team of threads, and one row alone: the same bits."""
    generator = torch.Generator().manual_seed(7)
    x, delta = torch.randn(200, 576, generator=generator), torch.randn(200, 576, generator=generator)
    weight, h = torch.randn(576, generator=generator), torch.randn(200, 3072, generator=generator)
    normed = _with_threads(threads, lambda: add_rms_norm(x.clone(), delta, weight, 1e-6))
    gated = _with_threads(threads, lambda: silu_mul(h))
    for row in (0, 57, 199):
        assert torch.equal(add_rms_norm(x[row : row + 1].clone(), delta[row : row + 1], weight, 1e-6),
                           normed[row : row + 1])
        assert torch.equal(silu_mul(h[row : row + 1]), gated[row : row + 1])


def test_the_angle_table_is_bitwise_the_models_rotary_embedding():
    """Row p of the forward's table is what the model's rotary embedding computes at position p,
    whatever positions it is computed beside; the table grows past its first length."""
    from specbatch.models.llama import _signed_sin

    engine = Engine(tiny_llama(1, seed=0), max_sequences=1)
    forward = engine.forward
    positions = torch.tensor([[0, 5, 1023, 3000]])
    cos_table, signed_sin_table = forward._angle_table(3000)
    assert cos_table.shape[0] >= 3001
    cos, sin = forward.rotary(forward.embed[:1], positions)
    assert torch.equal(cos_table[positions[0]], cos[0]) and torch.equal(signed_sin_table[positions[0]],
                                                                          _signed_sin(sin[0]))


def test_the_engine_runs_layer_ops_natively_in_float32_with_pytorchs_results():
    """The own forward uses the small-operation kernels for float32 on a CPU; its logits are the
    PyTorch operators' within float32 rounding, for a prompt and for a step."""
    engine = Engine(tiny_llama(2, seed=1), max_sequences=2)
    assert engine.forward.native_layer_ops
    prompt = list(range(3, 40))

    def logits(native_ops: bool) -> tuple[torch.Tensor, torch.Tensor]:
        engine.forward.native_layer_ops = native_ops
        batch = engine.start([SequenceInput("a", 0, prompt)], create=True)
        first = batch.prefill(1)
        batch.commit([len(prompt)])
        step = engine.start([SequenceInput("a", len(prompt), [5, 6, 7])])
        return first, step.prefill(3)

    for ours, theirs in zip(logits(True), logits(False)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert not Engine(tiny_llama(1, seed=0).to(torch.bfloat16)).forward.native_layer_ops


def test_engine_layers_pick_the_panel_kernel_for_float32_only():
    weight = torch.randn(32, 16)
    assert type(linear(weight)).__name__ == "PanelLinear"
    assert type(linear(weight.to(torch.bfloat16))).__name__ == "PackedLinear"
    assert linear(weight, weights="bf16").bf16_weights and not linear(weight).bf16_weights
    with pytest.raises(ValueError, match="bf16 weights"):
        linear(weight.to(torch.bfloat16), weights="bf16")
    with pytest.raises(ValueError, match="unknown weight format"):
        linear(weight, weights="fp8")
    layers = [torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 24, bias=True)]
    both = fused(*layers)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = torch.cat([layer(x) for layer in layers], dim=-1)
    torch.testing.assert_close(both(x), expected, rtol=1e-5, atol=1e-5)
    assert both(torch.empty(0, 16)).shape == (0, 32)


def test_refuses_other_dtypes():
    layer = PanelLinear(torch.randn(16, 8))
    with pytest.raises(TypeError):
        layer(torch.randn(2, 8, dtype=torch.float64))


def test_switched_off_by_the_environment():
    code = "from specbatch.kernels import build; print(build.available(), build.unavailable_reason())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "SPECBATCH_NATIVE": "0"}, check=True)
    assert result.stdout.split() == ["False", "SPECBATCH_NATIVE=0"]


def test_builds_into_a_fresh_directory(tmp_path):
    """A cold cache compiles the library (as a fresh container or CI machine does) and reuses it."""
    built = build.build(tmp_path)
    assert built.parent == tmp_path and built.stat().st_size > 0
    assert build.build(tmp_path) == built and len(list(tmp_path.iterdir())) == 1  # no scratch left behind


def test_a_compiler_that_fails_is_reported(tmp_path, monkeypatch):
    """A broken $CC raises with the compiler's name (the engine then logs it and runs oneDNN)."""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        build.build(tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        build.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_argmax_is_torchs_on_ties_nans_infinities_and_signed_zeros():
    """The greedy verdict's argmax: torch.argmax's index in every case, the first of equal largest
    values, a row's first NaN, a row of -inf at 0, -0 and +0 equal; any row length (the 8-float
    passes and their tail); other dtypes go to PyTorch."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 49152, generator=generator)
    x[1, 100] = x[1].max() + 1
    x[1, 200] = x[1, 100]  # a tie: the first
    x[2] = 0.0
    x[2, 7] = -0.0
    x[3] = -float("inf")
    x[4, 5] = x[4, 9] = float("nan")
    x[5] = float("nan")
    x[6, -1] = x[6, -3] = 100.0  # in the tail past the last full 8
    x[7] = 1.0
    x[8] = -0.0
    x[8, 3] = 0.0
    x[9, 49150] = x[9, 20] = float("inf")
    for columns in (49152, 8192, 49149, 13, 8, 7, 1):
        rows = x[:, :columns]
        assert torch.equal(argmax(rows), rows.argmax(-1)), columns
        assert torch.equal(argmax(rows.reshape(3, 4, columns)), rows.reshape(3, 4, columns).argmax(-1))
    assert torch.equal(argmax(x.t()), x.t().argmax(-1))  # not contiguous: a contiguous copy
    assert torch.equal(argmax(x.double()), x.double().argmax(-1))
    for rows in (x, x.reshape(3, 4, -1), x.reshape(2, 3, 2, -1), x.t(), x[0], x.double(), x[:0]):
        assert argmax_list(rows) == rows.argmax(-1).tolist()  # Python ints, nested as tolist() nests them


@pytest.mark.skipif(not cpu.blocks_expected(), reason="the GGUF block multiplies do not build here")
def test_the_launcher_reads_which_build_the_block_multiplies_take_without_torch(monkeypatch):
    """Which profile the embedded pair's default takes depends on it: the torch-free reading agrees
    with the flags the kernels are built with, and an emulated AVX2-only CPU reads as one."""
    assert cpu.blocks_on_avx2() is not (set(build.VNNI_FLAGS) <= set(build.flags()))
    monkeypatch.setenv(cpu.WITHOUT_ENV, "avx512,amx")
    assert cpu.blocks_on_avx2() and set(build.VNNI_FLAGS).isdisjoint(build.flags())


@pytest.mark.skipif(not cpu.has("avx512f"), reason="this CPU builds the AVX2 kernels already")
def test_an_avx2_only_build_passes_these_tests_and_speculates_exactly(tmp_path):
    """The kernels built as an AVX2-only CPU builds them (SPECBATCH_CPU_WITHOUT=avx512,amx: 256-bit
    attention and GGUF block multiplies, no dot-product forms), in a process of its own: this file's
    tests and test_q4_1.py's (the block kernels' AVX2 code, the embedded target's form there), and
    speculation on bf16 weights token for token its own target-only decoding."""
    check = ("import sys, pytest; from specbatch.kernels import build; "
             "assert '-mavx512f' not in build.flags() and build.available() and not build.bf16_dot_available(); "
             "assert build.blocks_available(); from specbatch.kernels import cpu; assert cpu.blocks_on_avx2(); "
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-x', *sys.argv[1:], '-k', 'not avx2_only']))")
    env = {**os.environ, "SPECBATCH_CPU_WITHOUT": "avx512,amx", "SPECBATCH_CACHE": str(tmp_path)}
    here = Path(__file__)
    speculation = (str(here.parent / "test_eagle.py")
                   + "::test_bf16_weights_speculate_exactly_against_their_own_target_only_decoding[bf16]")
    done = subprocess.run([sys.executable, "-c", check, str(here), str(here.parent / "test_q4_1.py"), speculation],
                          env=env, capture_output=True, text=True, cwd=here.parents[1], timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout

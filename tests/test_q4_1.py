"""GGUF's Q4_1 and Q8_0 blocks (specbatch.kernels.gguf_blocks) and their multiplies (native panel_q4_1.c,
panel_q8_0.c): the blocks recovered from a dequantized weight bit for bit, other weights quantized as
llama.cpp does, each input row quantized to 8 bits as llama.cpp does, and the products row-exact; the
q4_1 form (Q4_1 layers, a Q8_0 head) through the launcher and the services."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_native import layer_and_rows, needs_blocks, rows_alone_and_beside_others
from tiny import greedy_mixed_batch, tiny_llama

from specbatch.config.options import UP, add_options
from specbatch.engine.engine import Engine
from specbatch.kernels.gguf_blocks import BLOCK, q4_1_blocks, q8_0_blocks
from specbatch.kernels.linear import linear
from specbatch.kernels.panel import PanelLinear
from specbatch.stack.defaults import stack_options


def q4_1_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight that is d * q + m in every block, as transformers dequantizes a GGUF's Q4_1."""
    generator = torch.Generator().manual_seed(seed)
    return q4_1_blocks(torch.randn(out_features, in_features, generator=generator) * 0.05).dequantize()


def test_the_blocks_of_a_dequantized_weight_are_recovered_bit_for_bit():
    weight = q4_1_weight(48, 4 * BLOCK, seed=1)
    weight[3, :BLOCK] = 0.25  # a constant block: d = 0
    weight[5, BLOCK : 2 * BLOCK] = torch.arange(BLOCK) % 16 * 2.0**-10 - 1.5  # q 0..15 twice, a float16 step
    blocks = q4_1_blocks(weight)
    assert blocks.recovered == blocks.blocks == 48 * 4
    assert torch.equal(blocks.dequantize(), weight)
    assert blocks.values.dtype == torch.uint8 and int(blocks.values.max()) <= 15
    assert float(blocks.scale[3, 0]) == 0 and float(blocks.minimum[3, 0]) == 0.25
    assert float(blocks.scale[5, 1]) == 2.0**-10 and float(blocks.minimum[5, 1]) == -1.5


def test_other_weights_are_quantized_as_llama_cpp_does():
    """A weight that is not Q4_1 already: each block's minimum becomes m, its span over 15 d, and each
    value the nearest of the 16 levels (within float16's rounding of d and m)."""
    weight = torch.randn(16, 2 * BLOCK, generator=torch.Generator().manual_seed(2))
    blocks = q4_1_blocks(weight)
    assert blocks.recovered == 0
    d = blocks.scale.float().repeat_interleave(BLOCK, dim=1)
    assert ((blocks.dequantize() - weight).abs() <= d / 2 + 2e-3).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_1_blocks(torch.randn(4, 48))


def assert_row_exact_sums_of(terms: torch.Tensor, layer, weight, bias, x, threads: int) -> None:
    """``layer``'s rows are the sums of ``terms`` ([rows, outputs, blocks], exact in float64) plus the
    bias, within float32's rounding of one multiply-add a term; each row the same bits alone or beside
    others (1-12 rows one block, 13, 16, 17 and 40 split) on ``threads`` threads; and within 8 bits'
    error of the float32 product."""
    exact = terms.sum(-1) + bias.double()
    bound = 1e-6 * terms.shape[-1] * (terms.abs().sum(-1) + bias.double().abs() + 1e-6)
    alone = rows_alone_and_beside_others(layer, x, threads, list(range(1, 14)) + [16, 17, 40])
    assert ((alone.double() - exact).abs() <= bound).all()
    product = x.double() @ weight.double().T
    assert (alone.double() - product - bias.double()).norm() < 0.02 * product.norm()


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's blocks of 32 as the kernels quantize them (llama.cpp's Q8_0 and Q8_1), in float32:
    d_x = max|x| / 127 and q_x = round(x * (1 / d_x)), half to even. Returns (d_x, q_x)."""
    xb = x.view(len(x), -1, BLOCK)
    d_x = xb.abs().amax(-1) / 127
    return d_x, (xb * torch.where(d_x > 0, 1 / torch.where(d_x > 0, d_x, 1.0), 0.0)[..., None]).round()


@needs_blocks
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (33, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q4_1_products_are_row_exact_products_of_the_quantized_input(out_features, in_features, threads):
    """Each input row quantized to Q8_1 blocks of its own: the result is d_w d_x times the blocks'
    exact integer sums plus m_w s_x (s_x = d_x sum q_x), within float32 rounding; each row the same
    bits alone or beside others (1-12 rows one block, 13, 16, 17 and 40 split), on any thread count;
    and within 8 bits' error of the float32 product."""
    weight = q4_1_weight(out_features, in_features, seed=out_features + in_features)
    _, bias, _, x = layer_and_rows(out_features, in_features, out_features * in_features)
    x[3] = 0  # a row of zeros: every block's scale 0
    layer = PanelLinear(weight, bias, q4_1=True)
    blocks = q4_1_blocks(weight)
    assert layer.form == 5 and layer.recovered_blocks == (blocks.blocks,) * 2
    d_x, q_x = quantized_rows(x)
    sums = torch.einsum("mbk,nbk->mnb", q_x.double(), blocks.values.double())  # exact integers
    s_x = (d_x * q_x.sum(-1)).double()  # in float32 as the kernel computes it, then exact
    terms = (sums * (blocks.scale.float()[None] * d_x[:, None]).double()  # d_w d_x rounded to float32
             + blocks.minimum.double()[None] * s_x[:, None])
    assert_row_exact_sums_of(terms, layer, weight, bias, x, threads)


@needs_blocks
def test_q4_1_refuses_what_it_cannot_pack_or_combine():
    with pytest.raises(ValueError, match="multiple of 32"):
        linear(torch.randn(16, 40), weights="q4_1")
    with pytest.raises(ValueError, match="one of"):
        PanelLinear(torch.randn(16, 64), q4_1=True, bf16_weights=True)
    with pytest.raises(ValueError, match="one of"):
        PanelLinear(torch.randn(16, 64), q4_1=True, q8_0=True)
    with pytest.raises(ValueError, match="unknown weight form"):
        Engine(tiny_llama(1, seed=0), weights="q4_1+bf16-dot")
    with pytest.raises(ValueError, match="Q4_1 weights need the engine's own Llama forward"):
        Engine(tiny_llama(1, seed=0).to(torch.bfloat16), weights="q4_1")


@needs_blocks
def test_the_engine_puts_the_head_in_q8_0_blocks():
    engine = Engine(tiny_llama(2, seed=3), weights="q4_1")
    layer = engine.forward.layers[0]
    assert {layer.qkv.form, layer.o.form, layer.gate_up.form, layer.down.form} == {5}
    assert engine.forward.head.form == 6 and engine.forward.decoder_layers is not None


def q8_0_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight that is d * q in every block, as transformers dequantizes a GGUF's Q8_0."""
    generator = torch.Generator().manual_seed(seed)
    return q8_0_blocks(torch.randn(out_features, in_features, generator=generator) * 0.05).dequantize()


def test_q8_0_blocks_of_a_dequantized_weight_are_recovered_bit_for_bit():
    weight = q8_0_weight(48, 4 * BLOCK, seed=4)
    weight[3, :BLOCK] = 0  # a block of zeros: d = 0
    weight[5, BLOCK : 2 * BLOCK] = (torch.arange(BLOCK) - 16) * 2.0**-12  # d a float16 power of two, q -16..15
    weight[5, BLOCK] = 127 * 2.0**-12
    blocks = q8_0_blocks(weight)
    assert blocks.recovered == blocks.blocks == 48 * 4
    assert torch.equal(blocks.dequantize(), weight)
    assert blocks.values.dtype == torch.int8 and int(blocks.values.abs().max()) <= 127
    assert float(blocks.scale[3, 0]) == 0 and float(blocks.scale[5, 1]) == 2.0**-12


def test_other_weights_are_quantized_to_q8_0_as_llama_cpp_does():
    """d = max|w| / 127 (in float16) and each value the nearest multiple of it: within half a step
    (and float16's rounding of d)."""
    weight = torch.randn(16, 2 * BLOCK, generator=torch.Generator().manual_seed(6))
    blocks = q8_0_blocks(weight)
    assert blocks.recovered == 0
    d = blocks.scale.float().repeat_interleave(BLOCK, dim=1)
    assert ((blocks.dequantize() - weight).abs() <= d / 2 + 2e-3 * weight.abs()).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_blocks(torch.randn(4, 48))


@needs_blocks
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (33, 96), (4099, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_0_products_are_row_exact_products_of_the_quantized_input(out_features, in_features, threads):
    """Each input row quantized to Q8_0 blocks of its own (d_x = max|x| / 127, q_x = round(x / d_x)):
    the result is the blocks' exact integer sums scaled by d_w d_x (within float32 rounding), each
    row the same bits alone or beside others (1-12 rows one block, 13, 16, 17 and 40 split) on any
    thread count, and within 8 bits' error of the float32 product."""
    weight = q8_0_weight(out_features, in_features, seed=out_features + in_features)
    _, bias, _, x = layer_and_rows(out_features, in_features, out_features * in_features)
    x[3] = 0  # a row of zeros: every block's scale 0
    layer = PanelLinear(weight, bias, q8_0=True)
    blocks = q8_0_blocks(weight)
    assert layer.form == 6 and layer.recovered_blocks == (blocks.blocks,) * 2
    d_x, q_x = quantized_rows(x)
    sums = torch.einsum("mbk,nbk->mnb", q_x.double(), blocks.values.double())  # exact integers
    scales = (blocks.scale.float()[None] * d_x[:, None]).double()  # d_w d_x, rounded to float32 as the kernel does
    terms = sums * scales
    assert_row_exact_sums_of(terms, layer, weight, bias, x, threads)


@needs_blocks
def test_speculation_on_q4_1_layers_is_its_own_target_only_decoding(target_model, draft_model, tokenizer):
    """A target in the q4_1 form (bf16 keys and values, as `specbatch up` runs it) and a draft in Q8_0:
    greedy output at k = 3 with leaves, in one mixed batch, is token for token the same stack's
    target-only (k = 0) output."""
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=8, max_new_tokens=64,
                              target_engine_options={"weights": "q4_1", "kv_bf16": True},
                              draft_engine_options={"weights": "q8_0", "kv_bf16": True})
    try:
        speculative = greedy_mixed_batch(stack, seed=13, k=3)
        assert sum(r.stats.draft_tokens_accepted for r in speculative) > 0
        assert [r.token_ids for r in speculative] == [r.token_ids for r in greedy_mixed_batch(stack, seed=13, k=0)]
    finally:
        stack.stop()


@pytest.mark.parametrize("dot", [True, "fp16"])
def test_the_launcher_gives_the_target_q4_1_and_keeps_the_draft(monkeypatch, dot):
    """`specbatch up --weights q4_1`: the target service gets q4_1 (float32, bf16 keys and values),
    the embedded draft its usual Q8_0, and the profile looked up is the Q4_1 form's."""
    from test_processes import _flag, _spawned

    from specbatch.stack.defaults import StackOptions, default_k_policy

    spawned = _spawned(monkeypatch, {"weights": "q4_1"}, dot=dot)
    assert _flag(spawned["target_service"][0], "--weights") == "q4_1"
    assert _flag(spawned["draft_service"][0], "--weights") == "q8_0"
    policy, path = default_k_policy(StackOptions(weights="q4_1", device="cpu"))
    assert policy == "goodput:live" and path.endswith("embedded-cpu-q4_1-in-target.json")
    policy, path = default_k_policy(StackOptions(weights="q4_1", device="cpu", separate_draft=True))
    assert policy == "goodput:live" and path.endswith("embedded-cpu-q4_1.json")


@pytest.mark.parametrize("flags, message", [(["--dtype", "bfloat16"], "drop --dtype bfloat16"),
                                            (["--device", "cuda"], "for the CPU")])
def test_the_launcher_refuses_q4_1_where_it_cannot_run(flags, message):
    """Refused before any service starts, with the reason, instead of two services exiting."""
    parser = add_options(argparse.ArgumentParser(), UP)
    with pytest.raises(SystemExit, match=message):
        stack_options(parser.parse_args(["--weights", "q4_1", *flags]))


def test_the_launcher_refuses_q4_1_where_its_kernels_cannot_build(monkeypatch):
    from specbatch.kernels import cpu

    monkeypatch.setattr(cpu, "blocks_expected", lambda: False)
    parser = add_options(argparse.ArgumentParser(), UP)
    with pytest.raises(SystemExit, match="F16C"):
        stack_options(parser.parse_args(["--weights", "q4_1", "--device", "cpu"]))


def test_q8_0_is_refused_where_its_kernels_did_not_build(monkeypatch):
    """(q4_1's refusals: test_native.test_dot_product_forms_are_refused_where_the_cpu_lacks_them.)"""
    from specbatch.kernels import build

    monkeypatch.setattr(build, "blocks_available", lambda: False)
    with pytest.raises(RuntimeError, match="F16C"):
        PanelLinear(torch.randn(32, 64), q8_0=True)
    with pytest.raises(ValueError, match="F16C"):
        linear(torch.randn(32, 64), weights="q8_0")

"""The embedded SmolLM2-135M-Instruct through the three services (marked: slower, real weights)."""

from __future__ import annotations

import pytest
import torch

from specbatch.models.eagle import reads_target_features
from specbatch.models.embedded import EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, load_model, load_tokenizer
from specbatch.rpc.client import generate, generate_all, make_request

pytestmark = pytest.mark.real_model

CHATS = ["What is the capital of France?", "Write a haiku about autumn.", "Why is the sky blue?",
         "Name three programming languages and what they are good at."]


@pytest.fixture(scope="module")
def real():
    target = load_model(ModelSpec(), device="cpu", dtype=torch.float32)
    draft = load_model(ModelSpec(EMBEDDED_DRAFT), device="cpu", dtype=torch.float32)  # the shipped one
    assert reads_target_features(draft)
    tokenizer = load_tokenizer(ModelSpec())
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def real_stack(real):
    from specbatch.stack.in_process import start_local_stack

    target, draft, tokenizer = real
    stack = start_local_stack(target, draft, tokenizer, max_batch_size=4)
    yield stack
    stack.stop()


def chat_ids(tokenizer, text):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def reference(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_batch_of_one_matches_generate(real, real_stack):
    target, _, tokenizer = real
    prompt = chat_ids(tokenizer, CHATS[0])
    result = generate(real_stack.client(), make_request(prompt, 24, k=3, ignore_eos=True))
    assert result.token_ids == reference(target, prompt, 24)
    assert "Paris" in result.text


@pytest.mark.parametrize("k", [1, 5])
def test_concurrent_chats_match_generate(real, real_stack, k):
    target, _, tokenizer = real
    prompts = [chat_ids(tokenizer, c) for c in CHATS]
    results = generate_all(real_stack.client(), [make_request(p, 20, k=k, ignore_eos=True) for p in prompts],
                           timeout=300)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(target, prompt, 20)
    # The shipped draft is the trained one: its first drafted token is the target's choice far more
    # often than an untrained draft's (about 0.01); docs/decisions/eagle-draft.md has the rates.
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    if k == 1:
        assert accepted / proposed > 0.05


def test_chat_prompt_is_rendered_with_the_template(real, real_stack):
    _, _, tokenizer = real
    via_chat = generate(real_stack.client(), make_request(CHATS[2], 8, chat=True, ignore_eos=True))
    via_ids = generate(real_stack.client(), make_request(chat_ids(tokenizer, CHATS[2]), 8, ignore_eos=True))
    assert via_chat.stats.prompt_tokens == len(chat_ids(tokenizer, CHATS[2]))
    assert via_chat.token_ids == via_ids.token_ids


@pytest.fixture(scope="module")
def bf16_stack():
    from specbatch.stack.in_process import start_local_stack

    target = load_model(ModelSpec(), device="cpu", dtype=torch.bfloat16)
    draft = load_model(ModelSpec(EMBEDDED_DRAFT), device="cpu", dtype=torch.bfloat16)
    stack = start_local_stack(target, draft, load_tokenizer(ModelSpec()), max_batch_size=4)
    yield stack
    stack.stop()


def test_bf16_output_leaves_target_only_decoding_only_at_near_ties(real, bf16_stack):
    """bf16 rounds differently over more rows (docs/exactness.md), so verifying
    k+1 tokens may flip a greedy choice where the target's two best logits (nearly) tie: the
    reference is target-only decoding in bf16 through the same engine, and every output that
    leaves it must do so at a near-tie. The mismatches are counted and reported."""
    from specbatch.engine.exactness import first_mismatch, target_only

    _, _, tokenizer = real
    prompts = [chat_ids(tokenizer, c) for c in CHATS]
    references = [target_only(bf16_stack.target_engine, p, 24) for p in prompts]
    client = bf16_stack.client()
    outputs = [generate(client, make_request(p, 24, k=3, ignore_eos=True)).token_ids for p in prompts]
    outputs += [r.token_ids for r in generate_all(client, [make_request(p, 24, k=1 + i, ignore_eos=True)
                                                            for i, p in enumerate(prompts)], timeout=300)]
    mismatches = [m for out, ref in zip(outputs, references + references) if (m := first_mismatch(out, ref))]
    print(f"bf16: {len(mismatches)} of {len(outputs)} outputs leave target-only decoding, at top-2 gaps "
          f"{[round(m.gap, 3) for m in mismatches]}")
    assert all(m.near_tie for m in mismatches), mismatches


@pytest.mark.parametrize("form", ["bf16-dot", "fp16-dot", "q4_1"])
def test_bf16_dot_products_speculate_exactly_in_mixed_batches(real, form):
    """The embedded services' default where the CPU has AVX512_BF16 (AVX512_FP16): float32 with the
    linear layers on bf16 dot products (float16 products), the draft in Q8_0 blocks; and `--q4-1`'s target, its
    decoder layers in the GGUF's Q4_1 blocks. Row-exact multiplies and attention make speculative
    output equal target-only decoding on the same engine token for token, with prompts of different
    lengths prefilled together and k 1-4 in one batch. (Differences show only at near-ties, which
    four short chats rarely reach: tests/test_native.py checks the prefill's bits directly, and
    docs/exactness.md reports many more prompts.)"""
    from specbatch.engine.exactness import first_mismatch, target_only
    from specbatch.kernels import build
    from specbatch.stack.in_process import start_local_stack

    if not (build.fp16_dot_available() if form == "fp16-dot" else build.bf16_dot_available()):
        pytest.skip(f"the CPU lacks {'AVX512_FP16' if form == 'fp16-dot' else 'AVX512_BF16'}")
    target, draft, tokenizer = real
    stack = start_local_stack(target, draft, tokenizer, max_batch_size=4, target_engine_options={"weights": form},
                              draft_engine_options={"weights": "q8_0"})
    try:
        prompts = [chat_ids(tokenizer, c) for c in CHATS]
        assert len({len(p) for p in prompts}) > 1
        references = [target_only(stack.target_engine, p, 24) for p in prompts]
        outputs = [r.token_ids for r in generate_all(stack.client(), [make_request(p, 24, k=1 + i, ignore_eos=True)
                                                                       for i, p in enumerate(prompts)], timeout=300)]
        assert [first_mismatch(out, ref) for out, ref in zip(outputs, references)] == [None] * len(prompts)
    finally:
        stack.stop()


def test_the_embedded_targets_weights_are_its_gguf_blocks(real):
    """transformers dequantized the GGUF's Q4_1 layers and its Q8_0 head to float32; every block of
    every decoder layer, and of the head, is recovered from them bit for bit, so the q4_1 form
    multiplies by the file's own weights."""
    from specbatch.kernels.gguf_blocks import q4_1_blocks, q8_0_blocks

    target, _, _ = real
    for layer in target.model.layers:
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            blocks = q4_1_blocks(module.weight)
            assert blocks.recovered == blocks.blocks
            assert torch.equal(blocks.dequantize(), module.weight.detach())
    # The head (tied to the embedding) is Q8_0 in the file: not 4-bit blocks.
    head = target.lm_head.weight.detach()
    assert q4_1_blocks(head).recovered < q4_1_blocks(head).blocks // 100
    blocks = q8_0_blocks(head)
    assert blocks.recovered == blocks.blocks and torch.equal(blocks.dequantize(), head)

"""Tiny random-weight models and a word-level tokenizer: the fast tests need no downloads."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

VOCAB = 96
EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<pad>", "<s>", "</s>", "<unk>", ":"] + [f"w{i}" for i in range(VOCAB - 5)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _clear_cut(model, head_scale: float = 8.0):
    model.eval()
    model.generation_config.eos_token_id = None  # the reference decodes to max_new_tokens unless told
    # Random weights give flat logits; a larger output scale makes greedy choices clear-cut, so
    # float rounding between batch shapes cannot flip an argmax and tests stay deterministic.
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def tiny_llama(layers: int, seed: int, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    return _clear_cut(LlamaForCausalLM(config))


def tiny_opt(layers: int, seed: int, hidden: int = 64, **shape) -> OPTForCausalLM:
    """A tiny OPT; ``shape`` sets other OPTConfig fields (``word_embed_proj_dim``,
    ``do_layer_norm_before``, ``tie_word_embeddings``, …).

    Untied by default: with random weights, a tied head reads mostly the input token's own
    embedding back from the residual stream, and greedy decoding repeats one token for ever.
    """
    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=VOCAB, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
                       pad_token_id=0, **{"word_embed_proj_dim": hidden, "tie_word_embeddings": False, **shape})
    model = OPTForCausalLM(config)
    project_out = model.get_decoder().project_out
    if project_out is not None:  # outputs of about unit scale, like the final layer norm's
        with torch.no_grad():
            project_out.weight.mul_(1 / (config.init_std * hidden**0.5))
    return _clear_cut(model)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Target-only greedy decoding by transformers' own generate: the ground truth."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@contextmanager
def hooked_forwards(engine, before):
    """Call ``before(inputs)`` ahead of every forward the engine runs, with what the forward is fed
    (``input_ids``, ``position_ids``, ``attention_mask``: the engine's boolean 4D mask)."""
    forward = engine.forward

    def hooked(input_ids, positions, write_columns, kv, mask, logits_to_keep, features=None):
        before({"input_ids": input_ids, "position_ids": positions, "attention_mask": mask})
        return forward(input_ids, positions, write_columns, kv, mask, logits_to_keep, features)

    engine.forward = hooked
    try:
        yield
    finally:
        engine.forward = forward


class ForgetEveryThird:
    """A Generate stream's ``on_response``: every third response, ``engine`` (a draft's) drops all
    its sequences, as a draft that restarted mid-request. ``responses`` counts what was seen."""

    def __init__(self, engine):
        self.engine, self.responses = engine, []

    def __call__(self, response) -> None:
        self.responses.append(response)
        if len(self.responses) % 3 == 0:
            self.engine.run(lambda: self.engine.release(list(self.engine.sequences)))


def decode_while_the_draft_forgets(stack, target_model, prompt: list[int], max_new_tokens: int = 40) -> int:
    """One greedy k = 2 request through ``stack`` whose (first) draft drops all its sequences every
    third response (``ForgetEveryThird``); asserts the output is target-only decoding and returns
    how many responses streamed."""
    from specbatch.rpc.client import generate, make_request

    forget_every_third = ForgetEveryThird(stack.draft_engines[0])
    result = generate(stack.client(), make_request(prompt, max_new_tokens, k=2, ignore_eos=True),
                      on_response=forget_every_third)
    assert result.token_ids == greedy_reference(target_model, prompt, max_new_tokens)
    return len(forget_every_third.responses)


def with_threads(threads: int, fn):
    """``fn()`` with torch's intra-op thread count set to ``threads``, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def random_prompts(seed: int, count: int = 6) -> list[list[int]]:
    """``count`` short random prompts (seeded): 1 to 19 tokens after a leading 1."""
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(count)]


def greedy_mixed_batch(stack, seed: int, k: int, prompts: int = 6) -> list:
    """Six short random prompts (seeded) decoded greedily together through ``stack`` at ``k``, with
    one leaf: the results (30 tokens each), in prompt order."""
    from specbatch.rpc.client import generate_all, make_request

    chosen = random_prompts(seed, prompts)
    return generate_all(stack.client(), [make_request(p, 30, k=k, ignore_eos=True, leaves=1) for p in chosen],
                        concurrency=len(chosen))

"""The evaluate phase of `specbatch distill` (and benchmarks/draft_eval.py): greedy speculative decoding
on held-out prompts with the services' code in process: acceptance per drafted position, tokens per
target forward, and the draft's cost per token beside the target's one-token forward."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specbatch.commands.distill.config import DistillConfig

# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.
from specbatch.commands.distill.data import (
    EVAL_PROMPTS_FROM,
    _progress,
    chat_prompt_ids,
)
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine


@dataclass
class Evaluation:
    prompts: int
    k: int
    steps: int
    tokens: int
    acceptance: float  # accepted / proposed over all drafted positions
    acceptance_by_position: list[float]  # P(position j accepted | positions < j accepted)
    tokens_per_step: float
    draft_ms_per_token: float  # one drafted token at batch 1
    target_ms_per_forward: float  # one target forward of one new token at batch 1
    cost_ratio: float


def evaluate(target, draft, tokenizer, cfg: DistillConfig, eos: set[int]) -> Evaluation:
    """Greedy speculative decoding at batch 1 on held-out prompts (ShareGPT from conversation
    ``EVAL_PROMPTS_FROM``), with the services' code."""
    texts = sharegpt_prompts(cfg.eval_prompts, start=EVAL_PROMPTS_FROM)
    prompts = [chat_prompt_ids(tokenizer, text, cfg.max_prompt_tokens) for text in texts]
    return speculate(target, draft, prompts, cfg.eval_k, cfg.eval_new_tokens, eos, "evaluate: held-out prompts")


@dataclass
class SpeculativeStep:
    """One step of ``greedy_speculative_steps``."""

    drafts: list[int]  # what the draft proposed
    verdict: object  # target_service.verifier.Verdict: accepted count, next token, features
    propose_seconds: float  # the draft's call, wall time
    read_prompt: bool  # that call also read the prompt: a prefill, timed by neither side


@torch.inference_mode()
def greedy_speculative_steps(target_engine: Engine, draft_engine: Engine, prompts: list[list[int]], k: int,
                             new_tokens: int, eos: set[int], prompt_done=None):
    """Greedy speculative decoding at batch 1, one prompt after another, through the target
    service's verifier and the draft service's proposer on the given engines: yields every step.
    ``prompt_done()``, if given, is called after each prompt."""
    from draft_service.proposer import ProposeItem, propose
    from target_service.verifier import VerifyItem, verify

    for n, prompt in enumerate(prompts):
        seq = f"eval-{n}"
        (verdict,) = verify(target_engine, [VerifyItem(SequenceInput(seq, 0, prompt))], create=True, return_features=True)
        history, features = prompt + [verdict.next_token], [verdict.features]
        target_len, draft_len = verdict.cached_len, 0
        while len(history) - len(prompt) < new_tokens and history[-1] not in eos:
            feats = torch.cat(features)
            fed = torch.cat([torch.zeros(1, feats.shape[1]), feats])[draft_len : len(history)]
            started = time.perf_counter()
            (drafts,) = propose(draft_engine, [ProposeItem(SequenceInput(seq, draft_len, history[draft_len:], fed), k)])
            seconds = time.perf_counter() - started
            (verdict,) = verify(target_engine, [VerifyItem(SequenceInput(seq, target_len, history[target_len:]), drafts)],
                                return_features=True)
            yield SpeculativeStep(drafts, verdict, seconds, read_prompt=draft_len == 0)
            draft_len = len(history)  # the draft keeps only what it read with true features
            history += drafts[: verdict.accepted] + [verdict.next_token]
            features.append(verdict.features)
            target_len = verdict.cached_len
        target_engine.release([seq])
        draft_engine.release([seq])
        if prompt_done:
            prompt_done()


@torch.inference_mode()
def speculate(target, draft, prompts: list[list[int]], k: int, new_tokens: int, eos: set[int],
              description: str = "speculate") -> Evaluation:
    """Greedy speculative decoding at batch 1 (``greedy_speculative_steps``), each model on the
    device it is on: acceptance per drafted position, tokens per target forward, and the draft's
    time per drafted token (steady state: the call that reads the prompt is not timed) beside one
    one-token target forward."""
    target_engine, draft_engine = Engine(target, max_sequences=2), Engine(draft, max_sequences=2)
    reached = [0] * (k + 1)  # reached[j]: steps where positions 1..j were all accepted
    steps = tokens = 0
    draft_seconds = draft_tokens = 0.0
    progress, task = _progress(len(prompts), description)
    with progress:
        for step in greedy_speculative_steps(target_engine, draft_engine, prompts, k, new_tokens, eos,
                                             lambda: progress.advance(task)):
            if not step.read_prompt:
                draft_seconds += step.propose_seconds
                draft_tokens += k
            for j in range(step.verdict.accepted + 1):
                reached[j] += 1
            steps += 1
            tokens += step.verdict.accepted + 1
    by_position = [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, k + 1)]
    accepted = sum(reached[1:])
    target_ms = _target_forward_ms(target_engine)
    draft_ms = 1000 * draft_seconds / max(draft_tokens, 1)
    return Evaluation(len(prompts), k, steps, tokens, accepted / max(steps * k, 1), by_position,
                      tokens / max(steps, 1), draft_ms, target_ms, draft_ms / target_ms)


def _target_forward_ms(engine: Engine, context: int = 128, repeats: int = 20) -> float:
    """Median time of a one-new-token target forward at batch 1 (with ``context`` cached)."""
    from target_service.verifier import VerifyItem, verify

    context = min(context, engine.max_context - 2)
    tokens = [(10 + i) % engine.vocab_size for i in range(context)]
    verify(engine, [VerifyItem(SequenceInput("timing", 0, tokens))], create=True)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        verify(engine, [VerifyItem(SequenceInput("timing", context, [11]))])
        times.append(time.perf_counter() - started)
    engine.release(["timing"])
    return 1000 * sorted(times)[len(times) // 2]


def find_eos_token_ids(tokenizer, target) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(target.generation_config, "eos_token_id", None) if getattr(target, "generation_config", None) else None
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def print_evaluation(e: Evaluation) -> None:
    positions = " ".join(f"{a:.2f}" for a in e.acceptance_by_position)
    print(f"evaluation on {e.prompts} held-out prompts, k={e.k}, batch 1, greedy:\n"
          f"  acceptance {e.acceptance:.3f} per drafted token; by position {positions}\n"
          f"  {e.tokens_per_step:.2f} tokens per target forward ({e.tokens} tokens in {e.steps} steps)\n"
          f"  draft {e.draft_ms_per_token:.2f} ms per token vs target forward {e.target_ms_per_forward:.2f} ms "
          f"(cost ratio {e.cost_ratio:.3f})", flush=True)

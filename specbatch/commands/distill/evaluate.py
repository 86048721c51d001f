"""The evaluate phase of `specbatch distill` (and benchmarks/draft_eval.py): greedy speculative decoding
on held-out prompts with the coordinator's decode step and the services' code in process: acceptance
per drafted position, tokens per target forward, and the draft's cost per token beside the target's
one-token forward."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from coordinator.by_hand import greedy_request, stepped_by_hand
from coordinator.in_process import InProcessDraft, InProcessTarget
from coordinator.policy import FixedK
from draft_service.servicer import DraftServicer
from specbatch.commands.distill.config import DistillConfig, engine_options

# The data phase (answers, corpus, shards, the head's token subset) is distill_data's.
from specbatch.commands.distill.data import (
    EVAL_PROMPTS_FROM,
    _progress,
    chat_prompt_ids,
)
from specbatch.commands.prompts import sharegpt_prompts
from specbatch.config.speculation import SpeculationConfig
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.protocol.speculation import tally_positions
from target_service.servicer import TargetServicer
from target_service.verifier import VerifyItem, verify


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
    return speculate(target, draft, prompts, cfg.eval_k, cfg.eval_new_tokens, eos, "evaluate: held-out prompts",
                     engine_options(cfg, target))


@dataclass
class SpeculativeStep:
    """One decode step of one prompt (``speculative_steps``), as the coordinator's step ran it."""

    drafted: int  # tokens the draft proposed (fewer than k where the answer has less room left)
    accepted: int  # of them, the ones the target kept
    next_token: int | None  # the target's token after them; None where an accepted draft ended the answer
    propose_seconds: float  # what the draft computed for the step's Propose
    read_prompt: bool  # that Propose also read the prompt: a prefill, timed by neither side


def speculative_steps(target_engine: Engine, draft_engine: Engine, prompts: list[list[int]], k: int,
                      new_tokens: int, eos: set[int], prompt_done=None) -> Iterator[SpeculativeStep]:
    """Greedy speculative decoding at batch 1 and a fixed k, one prompt after another, through the
    coordinator's own scheduler and decode step (stepped by hand: coordinator/by_hand.py), its
    calls made on the target and draft services' servicers over the given engines, in process:
    yields every step. No prompt lookup, no leaves: every draft is the draft model's.
    ``prompt_done()``, if given, is called after each prompt."""
    target = InProcessTarget(TargetServicer(target_engine, "target"))
    draft = InProcessDraft(DraftServicer(draft_engine, "draft"))
    target_stats, draft_stats = target.cache_stats(), draft.cache_stats()
    max_context = min(target_stats.max_context, draft_stats.max_context)
    speculation = SpeculationConfig(k_policy=f"fixed:{k}", leaves=0, prompt_lookup=0, shared_lookup=0)
    for n, prompt in enumerate(prompts):
        request = greedy_request(f"eval-{n}", prompt, new_tokens, stop_token_ids=eos)
        with stepped_by_hand(target, draft, [request], FixedK(k), speculation, max_context,
                             draft_stats.feature_size) as scheduler:
            while request.finish is None:
                before, read_prompt = len(request.history), request.draft_len == 0
                stats = scheduler.step()
                if stats is None or not stats.batch_size:
                    raise RuntimeError(f"prompt {n}: the step left its request out (a service refused it?)")
                drafted, accepted = stats.outcomes[0] if stats.outcomes else (0, 0)
                after = request.history[before + accepted :]
                yield SpeculativeStep(drafted, accepted, after[0] if after else None, stats.draft_compute_seconds,
                                      read_prompt)
        if prompt_done:
            prompt_done()


def speculate(target, draft, prompts: list[list[int]], k: int, new_tokens: int, eos: set[int],
              description: str = "speculate", target_options: dict | None = None) -> Evaluation:
    """Greedy speculative decoding at batch 1 (``speculative_steps``), each model on the device it
    is on: acceptance per drafted position, tokens per target forward, and the draft's time per
    drafted token (steady state: a Propose that reads the prompt is not timed) beside one
    one-token target forward. ``target_options``: the target engine's weight form (``Engine``'s
    ``weights`` and ``kv_bf16``; default: as loaded)."""
    target_engine = Engine(target, max_sequences=2, **(target_options or {}))
    draft_engine = Engine(draft, max_sequences=2)
    outcomes = []  # (drafted, accepted) of every step
    draft_seconds = draft_tokens = 0.0
    progress, task = _progress(len(prompts), description)
    with progress:
        for step in speculative_steps(target_engine, draft_engine, prompts, k, new_tokens, eos,
                                      lambda: progress.advance(task)):
            if not step.read_prompt:
                draft_seconds += step.propose_seconds
                draft_tokens += step.drafted
            outcomes.append((step.drafted, step.accepted))
    reached, kept = tally_positions(outcomes, k)
    by_position = [a / r if r else 0.0 for r, a in zip(reached, kept)]
    steps = len(outcomes)
    drafted, accepted = sum(d for d, _ in outcomes), sum(a for _, a in outcomes)
    target_ms = _target_forward_ms(target_engine)
    draft_ms = 1000 * draft_seconds / max(draft_tokens, 1)
    return Evaluation(len(prompts), k, steps, accepted + steps, accepted / max(drafted, 1), by_position,
                      (accepted + steps) / max(steps, 1), draft_ms, target_ms, draft_ms / target_ms)


@torch.inference_mode()
def _target_forward_ms(engine: Engine, context: int = 128, repeats: int = 20) -> float:
    """Median time of a one-new-token target forward at batch 1 (with ``context`` cached)."""
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

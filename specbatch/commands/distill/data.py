"""The data phase of ``specbatch distill`` (``specbatch.commands.distill.run``): the target's answers
to training prompts and its reading of ShareGPT conversations, each token with its feature, kept in
safetensors shards that training reads lazily (``FeatureShards``); and the draft head's token
subset chosen from that data."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from specbatch.commands.distill.config import DistillConfig, engine_options
from specbatch.commands.prompts import sharegpt_exchanges, sharegpt_prompts
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.models.loading import chat_token_ids

log = logging.getLogger(__name__)

TRAIN_PROMPTS_FROM = 0  # ShareGPT conversation index where training prompts start
CORPUS_FROM = 4000  # where the corpus conversations (ShareGPT's own answers) start
EVAL_PROMPTS_FROM = 16000  # held out: training never reads this far (the file holds ~17.6k)


def _progress(total: int, description: str):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False)
    task = progress.add_task(description, total=total, info="")
    return progress, task


def chat_prompt_ids(tokenizer, text: str, limit: int) -> list[int]:
    """A user turn as the coordinator renders it, cut to its last ``limit`` tokens."""
    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])[-limit:]


# ---- 1. data ---------------------------------------------------------------------------------------

def answer_with_features(engine: Engine, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                         tag: str) -> list[dict]:
    """Greedy answers for a batch of prompts, through the target service's verifier; returns per
    sequence its tokens and the target's final hidden state at every token it fed."""
    from target_service.verifier import VerifyItem, verify

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    seqs = [{"tokens": list(p), "features": []} for p in prompts]
    calls = [VerifyItem(SequenceInput(seq_id, 0, list(p))) for seq_id, p in zip(ids, prompts)]
    live = list(range(len(prompts)))
    try:
        for step in range(max_new_tokens):
            verdicts = verify(engine, [calls[i] for i in live], create=step == 0, return_features=True)
            still = []
            for i, verdict in zip(live, verdicts):
                seqs[i]["features"].append(verdict.features.to(torch.float16))
                seqs[i]["tokens"].append(verdict.next_token)
                if verdict.next_token not in eos:
                    calls[i] = VerifyItem(SequenceInput(ids[i], verdict.cached_len, [verdict.next_token]))
                    still.append(i)
            # Release finished answers at once: the live ones then hold neighbouring slots, and
            # a step over them stays a view of the pool instead of a gather.
            engine.release([ids[i] for i in live if i not in still])
            live = still
            if not live:
                break
    finally:
        engine.release(ids)
    return [{"tokens": torch.tensor(s["tokens"], dtype=torch.int32), "features": torch.cat(s["features"])}
            for s in seqs]


def collect_data(target, tokenizer, out: Path, cfg: DistillConfig, eos: set[int]) -> list[Path]:
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    texts = sharegpt_prompts(cfg.prompts, start=TRAIN_PROMPTS_FROM, end=EVAL_PROMPTS_FROM)
    if len(texts) < cfg.prompts:
        log.warning("only %d ShareGPT prompts before the held-out conversations (%d asked)", len(texts), cfg.prompts)
    prompts = [chat_prompt_ids(tokenizer, t, cfg.max_prompt_tokens) for t in texts]
    waves = [prompts[i : i + cfg.data_batch] for i in range(0, len(prompts), cfg.data_batch)]
    engine = Engine(target, max_sequences=cfg.data_batch, **engine_options(cfg, target))
    return _sharded(folder, "wave", waves, "data: target answers",
                    lambda w, wave: answer_with_features(engine, wave, cfg.max_new_tokens, eos, f"w{w}"))


def _sharded(folder: Path, prefix: str, batches: list, description: str, make) -> list[Path]:
    """``make(index, batch)`` for every batch, each result saved as a shard; a shard already
    there is kept instead, so an interrupted run resumes where it stopped. Returns the shards'
    paths: nothing is kept in memory (``FeatureShards`` reads them lazily)."""
    progress, task = _progress(len(batches), description)
    paths: list[Path] = []
    with progress:
        for index, batch in enumerate(batches):
            shard = folder / f"{prefix}-{index:04d}.safetensors"
            legacy = shard.with_suffix(".pt")  # a run started before shards were safetensors
            if not shard.exists():
                write_shard(shard, torch.load(legacy) if legacy.exists() else make(index, batch))
            paths.append(shard)
            progress.advance(task)
    return paths


def write_shard(path: Path, sequences: list[dict]) -> None:
    """Sequences as one safetensors file: all tokens, all features, and where each sequence
    starts (a sequence has a feature per token it fed, so one fewer than its tokens when the
    last, generated token was never fed). Written aside and renamed in: a shard is whole or absent."""
    from safetensors.torch import save_file

    def offsets(lengths):
        return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)

    tensors = {
        "tokens": torch.cat([s["tokens"].to(torch.int32) for s in sequences]),
        "features": torch.cat([s["features"].to(torch.float16) for s in sequences]),
        "token_offsets": offsets([len(s["tokens"]) for s in sequences]),
        "feature_offsets": offsets([len(s["features"]) for s in sequences]),
    }
    staging = path.with_suffix(".tmp")
    save_file(tensors, staging)
    staging.rename(path)


class FeatureShards(Sequence):
    """The data phase's sequences (``{"tokens", "features"}`` dicts), in shard order, read from
    the shards on demand: a shard is memory-mapped the first time one of its sequences is asked
    for, and only that sequence's rows are read. A 30 M-token run holds ~35 GB of float16
    features; this keeps them on disk (the page cache does the rest) instead of in one list."""

    def __init__(self, paths: list[Path], max_open: int = 64):
        from safetensors import safe_open

        self._open_file = lambda path: safe_open(str(path), framework="pt")
        self.paths = list(paths)
        self._rows: list[tuple[int, int]] = []  # sequence index -> (shard, row in shard)
        self._offsets: list[tuple[list[int], list[int]]] = []  # per shard: token, feature offsets
        for shard, path in enumerate(self.paths):
            with self._open_file(path) as handle:
                token_offsets = handle.get_tensor("token_offsets").tolist()
                feature_offsets = handle.get_tensor("feature_offsets").tolist()
            self._offsets.append((token_offsets, feature_offsets))
            self._rows.extend((shard, row) for row in range(len(token_offsets) - 1))
        self.max_open = max_open
        self.opened: OrderedDict[int, object] = OrderedDict()  # shard -> open handle, least recent first

    def __len__(self) -> int:
        return len(self._rows)

    def _handle(self, shard: int):
        if shard in self.opened:
            self.opened.move_to_end(shard)
        else:
            if len(self.opened) >= self.max_open:  # bounded: a long run must not hold every file open
                self.opened.popitem(last=False)
            self.opened[shard] = self._open_file(self.paths[shard])
        return self.opened[shard]

    def __getitem__(self, index: int) -> dict:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        shard, row = self._rows[index]
        token_offsets, feature_offsets = self._offsets[shard]
        handle = self._handle(shard)
        return {"tokens": handle.get_slice("tokens")[token_offsets[row] : token_offsets[row + 1]],
                "features": handle.get_slice("features")[feature_offsets[row] : feature_offsets[row + 1]]}

    def token_sequences(self):
        """Every sequence's tokens, one shard read at a time (no features): for the vocabulary."""
        for path, (token_offsets, _) in zip(self.paths, self._offsets):
            with self._open_file(path) as handle:
                tokens = handle.get_tensor("tokens")
            for start, end in zip(token_offsets, token_offsets[1:]):
                yield tokens[start:end]


def collect_corpus(target, tokenizer, out: Path, cfg: DistillConfig) -> list[Path]:
    """ShareGPT exchanges (a user turn and ChatGPT's answer) read by the target in one forward
    each: five times cheaper per token than the target's own answers on a CPU, and the draft
    learns the same function (token + target feature -> next target feature) from them."""
    from target_service.verifier import VerifyItem, verify

    if not cfg.corpus_tokens:
        return []
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    texts: list[torch.Tensor] = []  # int32: a 30 M-token corpus in 120 MB, not a GB of Python ints
    total = 0
    for user, answer in sharegpt_exchanges(cfg.corpus_tokens // 50 + 16, start=CORPUS_FROM, end=EVAL_PROMPTS_FROM):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        ids = chat_token_ids(tokenizer, messages, add_generation_prompt=False)[: cfg.corpus_max_tokens]
        texts.append(torch.tensor(ids, dtype=torch.int32))
        total += len(ids)
        if total >= cfg.corpus_tokens:
            break
    size = max(cfg.data_batch // 2, 1)
    batches = [texts[i : i + size] for i in range(0, len(texts), size)]
    engine = Engine(target, max_sequences=size, **engine_options(cfg, target))

    def read(index: int, batch: list[torch.Tensor]) -> list[dict]:
        ids = [f"c{index}-{i}" for i in range(len(batch))]
        verdicts = verify(engine, [VerifyItem(SequenceInput(i, 0, t.tolist())) for i, t in zip(ids, batch)],
                          create=True, return_features=True)
        engine.release(ids)
        return [{"tokens": t, "features": v.features.clone()}
                for t, v in zip(batch, verdicts)]

    return _sharded(folder, "corpus", batches, "data: target reads corpus", read)


# ---- 2. vocabulary ---------------------------------------------------------------------------------

def token_subset(sequences, size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` tokens the target most often produces (special tokens always in), sorted;
    ``sequences``: the token tensors of the data."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in sequences:
        counts += torch.bincount(tokens[1:].long(), minlength=vocab_size)
    for token in always:
        counts[token] = counts.max() + 1
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


def coverage(sequences, subset: torch.Tensor, vocab_size: int) -> float:
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[subset] = True
    hits = total = 0
    for tokens in sequences:
        tokens = tokens[1:].long()
        hits += int(inside[tokens].sum())
        total += len(tokens)
    return hits / max(total, 1)


# ---- 3. training -----------------------------------------------------------------------------------

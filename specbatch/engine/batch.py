"""One call's sequences as a ragged batch over their pool slots (see ``specbatch.engine.engine``).

A call runs only the new tokens of each of its sequences, right-aligned in one forward: each row
writes its keys and values straight into its own slot's next columns, and a 4D mask lets it see
exactly its own columns. Rolling back is setting a length; a padding token writes to a scratch
column past every row's end. Calls of very different lengths run as forwards of similar ones
(``length_groups``), and a call with leaves is a tree of tokens (``tree_layout``)."""

from __future__ import annotations

import contextlib
import functools
from array import array
from dataclasses import dataclass

import torch

from specbatch.engine.captured import CapturedForward
from specbatch.engine.device import eager_attention, to_device
from specbatch.engine.kv_pool import tree_mask, write_columns_and_mask


@dataclass
class SequenceInput:
    """What one call asks of one sequence: keep ``keep_len`` cached tokens, then feed ``tokens``."""

    seq_id: str
    keep_len: int
    tokens: list[int]
    features: torch.Tensor | None = None  # [len(tokens), feature_size]: for drafts that read target features
    # A tree of tokens instead of a chain (a verify call with leaves: specbatch.engine.acceptance): for each
    # token, the index of the fed token it follows, or -1 for the last cached one. Parents come
    # before their children. None: a chain, each token follows the one before it.
    parents: list[int] | None = None


# Up to this many token slots (rows x width) a call's index tensors are built from Python lists:
# a tensor operation costs about what a list of that size does, and a decode or verify step's
# Python is a large part of its time on a CPU. Past it (a prefill), tensor operations.
LIST_BUILT_SLOTS = 1024


def right_aligned(kept: list[int], fed: list[int], width: int, tokens: list[list[int]]):
    """(valid, columns, input ids), each ``[rows, width]``, of rows feeding ``fed`` tokens right-
    aligned after ``kept`` cached ones: row r's token j sits at column kept+j-(width-fed); padding
    is invalid, at column 0, token 0."""
    if len(fed) * width <= LIST_BUILT_SLOTS:
        pads = [width - f for f in fed]
        return (torch.tensor([[j >= pad for j in range(width)] for pad in pads]),
                torch.tensor([[max(k + j - pad, 0) for j in range(width)] for k, pad in zip(kept, pads)]),
                torch.tensor([[0] * pad + list(row) for pad, row in zip(pads, tokens)], dtype=torch.long))
    offsets = torch.arange(width)[None, :] - (width - torch.tensor(fed))[:, None]
    input_ids = torch.zeros(len(fed), width, dtype=torch.long)
    for r, row in enumerate(tokens):
        input_ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
    return offsets >= 0, (torch.tensor(kept)[:, None] + offsets).clamp(min=0), input_ids


class HostIndices:
    """A chain call's token ids, positions, write columns and mask in plain Python buffers, laid out
    as ``right_aligned`` and ``write_columns_and_mask`` lay out their tensors, for a forward that
    reads them on the host (``reads_host_indices``: the CPU kernels take their addresses). Built
    without a tensor operation: at a step's few tokens each costs more than all of this in Python.
    ``ids``, ``positions``, ``columns``: ``array("q")`` ``[batch, width]`` row-major; ``seen``:
    ``array("B")`` ``[batch, width, end]``, 1 where a token may attend; ``ends``: each row's cache
    length after it (where its next token goes)."""

    def __init__(self, kept: list[int], fed: list[int], tokens: list[list[int]], scratch: int):
        self.batch, self.width = len(fed), max(fed)
        self.ends = [k + f for k, f in zip(kept, fed)]
        self.end = end = max(self.ends)  # every row feeds a token: one past the last column written
        self.ids, self.positions, self.columns, self.seen = array("q"), array("q"), array("q"), array("B")
        ones_then_zeros = b"\x01" * end + bytes(end)  # the mask of a token at position p: from end - 1 - p on
        for k, f, row in zip(kept, fed, tokens):
            pad = self.width - f
            # Padding: token 0 at the positions before the row's (none below 0), written to the
            # scratch column, seeing column 0 only (as a token at position 0 does).
            self.ids.extend([0] * pad)
            self.ids.extend(row)
            self.positions.extend([max(k + j, 0) for j in range(-pad, 0)])
            self.positions.extend(range(k, k + f))
            self.columns.extend([scratch] * pad)
            self.columns.extend(range(k, k + f))
            for p in [0] * pad + list(range(k, k + f)):
                self.seen.frombytes(ones_then_zeros[end - 1 - p : 2 * end - 1 - p])


class RaggedBatch:
    """The sequences of one call, as a batch cache over their pool slots (see the module docstring).

    Rows are the call's sequences in slot order; results come back in the call's order.
    """

    def __init__(self, engine, inputs: list[SequenceInput], decode_steps: int = 0):
        self.engine = engine
        self.order = sorted(range(len(inputs)), key=lambda i: engine.sequences[inputs[i].seq_id].slot)
        # Row r holds the call's item order[r]; item i sits in row inverse[i]. Usually the call
        # comes in slot order, and then rows need no reordering (on a GPU, two launches fewer a forward).
        self.in_order = self.order == list(range(len(inputs)))
        if not self.in_order:
            self.order_index = to_device(torch.tensor(self.order), engine.device)
            self.inverse = torch.empty_like(self.order_index)
            self.inverse[self.order_index] = torch.arange(len(self.order), device=engine.device)
        self.caches = [engine.sequences[inputs[i].seq_id] for i in self.order]
        self.inputs = [inputs[i] for i in self.order]
        kept, fed = [item.keep_len for item in self.inputs], [len(item.tokens) for item in self.inputs]
        self.kept_lengths, self.fed_lengths = kept, fed  # per row (``kept`` and ``fed``: as tensors)
        batch, width = len(inputs), max(fed)
        longest = max(k + f for k, f in zip(kept, fed)) + decode_steps
        pool = engine.pool
        pool.ensure(len(engine.sequences), longest + 1, engine.max_context + 1)
        for item in self.inputs:  # only now: a call refused above (no room in the pool) changes nothing
            engine.rollback(item.seq_id, item.keep_len)  # the caller dropped the rest; it gets overwritten
        slots = [cache.slot for cache in self.caches]
        # The batch cache's row of each of the call's rows: the call's own rows, unless spread.
        self.kv_rows = list(range(batch))
        self.spread = None
        self.gathered = False
        if slots != list(range(batch)) and self._spreads(slots[-1] + 1, width, longest):
            self._spread(slots)
        elif slots == list(range(slots[0], slots[0] + batch)):  # a view: writes land in the pool directly
            self.kv = pool.kv[:, :, slots[0] : slots[0] + batch]
        else:  # gather the slots (up to the longest row, plus scratch), write back on commit
            self.kv = pool.kv[:, :, slots, :, : longest + 1]
            self.gathered = True
        self.scratch = self.kv.shape[4] - 1
        self.tree = None if all(item.parents is None for item in self.inputs) else tree_layout(self.inputs, width)
        tokens = [item.tokens for item in self.inputs]
        # A chain over the call's own rows, on a forward that reads its inputs on the host: built in
        # Python (HostIndices); anything else as tensors.
        reads_host = getattr(engine.forward, "reads_host_indices", None)
        self.host = (HostIndices(kept, fed, tokens, self.scratch)
                     if self.tree is None and self.spread is None and reads_host is not None and reads_host() else None)
        input_ids = positions = None
        if self.host is None:
            self.valid, self.columns, input_ids = right_aligned(kept, fed, width, tokens)
            # A chain's tokens sit at their own positions; a tree's at their depth (tree_layout).
            positions = self.columns if self.tree is None else (self.kept[:, None] + self.tree[0]).clamp(min=0)
        features = None
        if engine.feature_size:  # right-aligned like the tokens; padding reads zeros
            rows = [item.features for item in self.inputs]
            if min(fed) == width and all(row.dtype == engine.dtype for row in rows):  # no padding: the rows as sent
                features = rows[0][None] if batch == 1 else torch.stack(rows)
            else:
                features = torch.zeros(batch, width, engine.feature_size, dtype=engine.dtype)
                for row, item in enumerate(self.inputs):
                    features[row, width - len(item.tokens) :] = item.features
        self._pending = (input_ids, positions, features)
        self.decoded = 0
        self.hidden: torch.Tensor | None = None  # the decoder's final hidden states of the last forward

    @functools.cached_property
    def kept(self) -> torch.Tensor:
        """Each row's cached tokens kept before its fed ones, ``[batch]``."""
        return torch.tensor(self.kept_lengths)

    @functools.cached_property
    def fed(self) -> torch.Tensor:
        """Each row's fed tokens, ``[batch]``."""
        return torch.tensor(self.fed_lengths)

    def _spreads(self, rows: int, width: int, longest: int) -> bool:
        """Whether the call runs over the pool's slots from 0 to its last (``rows`` of them), the
        slots between its own as padding rows: where the engine replays captured steps, which
        take only calls over the pool's slots from 0, and such a call fits one. On a GPU a few
        padding rows cost next to nothing, while a gathered call runs eagerly, several times slower
        (a Propose for the rows that did not find their drafts by lookup, say:
        docs/decisions/captured-steps.md)."""
        fits = getattr(self.engine.forward, "fits", None)
        return fits is not None and fits(rows, width, longest)

    def _spread(self, slots: list[int]) -> None:
        self.kv = self.engine.pool.kv[:, :, : slots[-1] + 1]  # the pool's view from slot 0
        self.kv_rows = slots
        self.spread = torch.tensor(slots)
        self.spread_on_device = to_device(self.spread, self.engine.device)

    def _spread_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The call's rows at their slots of the spread batch, zeros (padding) between."""
        index = self.spread if rows.device.type == "cpu" else self.spread_on_device
        out = rows.new_zeros((self.kv.shape[2],) + rows.shape[1:])
        out[index] = rows
        return out

    def _forward(self, input_ids, positions, valid, logits_to_keep: int, features=None,
                 columns: torch.Tensor | None = None) -> torch.Tensor:
        """``columns``: where each token writes, when not at its position (a tree)."""
        device = self.engine.device
        columns = positions if columns is None else columns
        sees = None if self.tree is None else self.tree[1]
        if self.spread is not None:  # padding rows feed no real token: they write scratch and see column 0
            input_ids, positions, valid, columns = (self._spread_rows(t) for t in (input_ids, positions, valid, columns))
            features = None if features is None else self._spread_rows(features)
            sees = None if sees is None else self._spread_rows(sees)
        columns, mask = self._columns_and_mask(columns, valid)
        if sees is not None:
            mask = tree_mask(mask, columns, valid, sees)
        forward = self.engine.forward
        if not getattr(forward, "takes_host_inputs", False):
            input_ids, positions, columns, mask = (to_device(t, device) for t in (input_ids, positions, columns, mask))
            features = None if features is None else to_device(features, device)
        # A captured forward chooses per call; any other runs eagerly (eager_attention says why).
        with contextlib.nullcontext() if isinstance(forward, CapturedForward) else eager_attention(device):
            logits, self.hidden = forward(input_ids, positions, columns, self.kv, mask, logits_to_keep, features)
        if self.spread is not None:
            logits, self.hidden = logits[self.spread_on_device], self.hidden[self.spread_on_device]
        return logits

    def _columns_and_mask(self, columns: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_columns_and_mask`` over the columns the call's valid tokens reach (padding rows
        of a spread call are invalid: they see column 0 only)."""
        # every row feeds at least one token (numpy on the host: see write_columns_and_mask)
        end = 1 + int(columns.numpy()[valid.numpy()].max() if columns.device.type == "cpu" else columns[valid].max())
        return write_columns_and_mask(columns, valid, self.scratch, end)

    def item_rows(self) -> list[int]:
        """The row of each of the call's items in the batch's cache (on the host)."""
        rows = [0] * len(self.order)
        for row, item in enumerate(self.order):
            rows[item] = self.kv_rows[row]
        return rows

    def _unsort(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.in_order else rows[self.inverse]

    def _unsort_list(self, rows: list) -> list:
        """``_unsort`` of a list of rows."""
        if self.in_order:
            return rows
        out = [None] * len(rows)
        for row, item in enumerate(self.order):
            out[item] = rows[row]
        return out

    @torch.inference_mode()
    def prefill(self, logits_to_keep: int = 1) -> torch.Tensor:
        """Run every row's new tokens; returns logits of the last ``logits_to_keep`` columns,
        rows in the call's order."""
        input_ids, positions, features = self._pending
        if self.host is not None:
            logits, self.hidden = self.engine.forward.on_host(self.host, self.kv, logits_to_keep, features)
            return self._unsort(logits)
        return self._unsort(self._forward(input_ids, positions, self.valid, logits_to_keep, features, self.columns))

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one more token per row (``tokens`` in the call's order, and for a draft that reads
        features, one ``[batch, feature_size]`` row each); returns ``[batch, vocab]``."""
        assert self.tree is None, "a tree call feeds its tokens at once"
        tokens = tokens.view(-1) if self.in_order else tokens.view(-1)[self.order_index]
        if features is not None and not self.in_order:
            features = features[self.order_index]
        positions = self.kept + self.fed + self.decoded
        self.decoded += 1
        fast = getattr(self.engine.forward, "decode", None)  # captured steps: far less host work a token
        if fast is not None:
            out = fast(tokens, to_device(positions, self.engine.device), int(positions.max()) + 1, self.kv,
                       None if features is None else to_device(features, self.engine.device),
                       rows=None if self.spread is None else self.spread_on_device)
            if out is not None:
                logits, hidden = out
                self.hidden = hidden[:, None]
                return self._unsort(logits)
        positions = positions[:, None]
        logits = self._forward(tokens[:, None], positions, torch.ones_like(positions, dtype=torch.bool), 1,
                               None if features is None else features[:, None])
        return self._unsort(logits[:, -1])

    @torch.inference_mode()
    def greedy_chain(self, steps: int, to_token: torch.Tensor | None,
                     first_logits: bool = False) -> tuple[list[list[int]], torch.Tensor | None] | None:
        """A greedy draft's whole proposal in one call, in place of ``prefill(1)`` and ``steps``
        ``decode`` calls each fed the last one's argmax (and last hidden state): the same tokens,
        ``steps + 1`` a row in the call's order, and with ``first_logits`` what ``prefill(1)``
        would have returned at the last column (else None). None where the forward cannot (not
        the CPU kernels, a tree, a spread batch): the caller then runs those calls."""
        chains = getattr(self.engine.forward, "chains_natively", None)
        if chains is None or not chains() or self.host is None or self.decoded:
            return None
        tokens, logits = self.engine.forward.greedy_chain(self.host, self.kv, self._pending[2], steps, to_token,
                                                          first_logits)
        self.decoded, self.hidden = steps, None
        return self._unsort_list(tokens), None if logits is None else self._unsort(logits)

    def last_hidden(self) -> torch.Tensor:
        """The final hidden states of the last forward, ``[batch, columns, hidden]``, rows in the
        call's order (right-aligned like the tokens)."""
        return self._unsort(self.hidden)

    def commit(self, keep: list[int], paths: list[list[int] | None] | None = None) -> None:
        """Per sequence (``keep`` in the call's order): keep the first ``keep[i]`` tokens it was fed.
        A tree keeps one path instead: ``paths[i]``, the indices of the fed tokens it keeps, in
        order; their keys/values move down to the columns right after the cache (``keep`` is
        then ``len(paths[i])``)."""
        for row, i in enumerate(self.order):
            cache, kept, n = self.caches[row], self.kept_lengths[row], keep[i]
            assert 0 <= n <= self.fed_lengths[row] + self.decoded
            path = paths[i] if paths is not None else None
            if path is not None:
                assert len(path) == n and all(a < b for a, b in zip(path, path[1:]))
                kv_row = self.kv_rows[row]
                for column, index in enumerate(path):  # sources never fall below their target
                    if index != column:
                        self.kv[:, :, kv_row, :, kept + column] = self.kv[:, :, kv_row, :, kept + index]
            if self.gathered:
                cache.kv[:, :, :, kept : kept + n] = self.kv[:, :, row, :, kept : kept + n]
            cache.length = kept + n


# How much padding a call of sequences of different lengths may carry before it runs as several
# forwards (``length_groups``): its rows are its longest sequence's tokens times its sequences. On
# the CPU kernels a forward of many rows costs its rows, so padding is waste; a forward of few rows
# costs its weights' stream, which a second forward would pay again.
PADDED_ROWS_PER_TOKEN = 1.25


PADDED_ROWS_FREE = 64


def length_groups(lengths: list[int], by_length: bool = True) -> list[list[int]]:
    """The indices of a call's sequences (``lengths``: tokens fed each) in the forwards that run
    them: one unless ``by_length``, else longest first, each forward taking the next sequences
    while its padded rows stay within PADDED_ROWS_PER_TOKEN times its tokens, or within
    PADDED_ROWS_FREE rows of them. Each group lists its sequences in the call's order."""
    if not by_length:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else None
        if group is not None:
            rows, tokens = (len(group) + 1) * lengths[group[0]], sum(lengths[j] for j in group) + lengths[i]
            if rows <= PADDED_ROWS_PER_TOKEN * tokens or rows - tokens <= PADDED_ROWS_FREE:
                group.append(i)
                continue
        groups.append([i])
    return [sorted(group) for group in groups]


def tree_layout(inputs: list[SequenceInput], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a call whose rows may be trees: each token's depth below its row's cache (its position
    is the cache length plus it), ``[batch, width]``, and which fed tokens each token sees,
    ``[batch, width, width]`` (itself and its ancestors), both right-aligned like the tokens.
    Rows without ``parents`` are chains."""
    batch = len(inputs)
    depth = torch.zeros(batch, width, dtype=torch.long)
    sees = torch.zeros(batch, width, width, dtype=torch.bool)
    for row, item in enumerate(inputs):
        fed = len(item.tokens)
        parents = item.parents if item.parents is not None else list(range(-1, fed - 1))
        first = width - fed
        for j, parent in enumerate(parents):
            column = first + j
            if parent >= 0:
                depth[row, column] = depth[row, first + parent] + 1
                sees[row, column] = sees[row, first + parent]
            sees[row, column, column] = True
    return depth, sees

"""The profile: measured step times over batch size × k for one deployment, and the best k per
batch size. ``specbatch profile`` writes it (specbatch/commands/profiler.py); the coordinator reads it
(``--profile``) for the ``profile`` and ``goodput`` k policies (coordinator/policy.py).

The document is versioned JSON (docs/speculation.md shows how the policies read it):

    format, version          "specbatch-profile", 1
    created                  ISO 8601 UTC time of the measurement
    hardware, target, draft  what was measured: device, models, dtypes (free-form objects)
    workload                 prompts and settings of the measurement (free-form)
    batch_sizes, max_k       the grid: every batch size × every k in 0 … max_k
    acceptance_by_position   P(draft position i is accepted | positions before it were), i < max_k
    table                    one row per (batch_size, k): draft_ms, target_ms, step_ms,
                             accepted_per_sequence (measured), ms_per_token (model, see below)
    best_k                   batch size (a string, as JSON keys are) -> k

``ms_per_token`` is the step time divided by the tokens the step is expected to yield: batch ×
(1 + expected accepted drafts), the latter from ``acceptance_by_position`` pooled over the whole
measurement. Pooling keeps every cell's estimate on the same thousands of drafted tokens instead
of the few dozen steps of that cell; acceptance does not depend on batch size (greedy), and the
step times in each cell are measured directly. ``best_k`` is, per batch size, the smallest k whose
``ms_per_token`` is within ``NEAR_BEST`` of the lowest (see there). It may be edited by hand: the
``profile`` policy follows ``best_k``, while ``goodput`` works from the table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "specbatch-profile"
VERSION = 1
CELL_TIMES = ("draft_ms", "target_ms", "step_ms")
# best_k takes the smallest k whose ms_per_token is within this fraction of the batch size's lowest:
# as fast as the profile can tell, with less work thrown away when drafts miss. A profile's close
# cells are inside its own resolution: repeated profiles of one machine put neighbouring k's a few
# percent either side of each other, and served runs do not follow such orderings. Cells 5 % apart
# or more keep the faster k (docs/decisions/k-policy-default.md). goodput keeps its own argmax over
# the table and live acceptance: the same rule there drafted too few tokens.
NEAR_BEST = 0.05


class ProfileError(ValueError):
    """A profile document that cannot be used; the message says where and why."""


def expected_tokens(acceptance: list[float] | tuple[float, ...], k: int) -> float:
    """Tokens one sequence gains from a step drafting k: the accepted drafts plus the target's
    own next token. Draft position i counts if it and every position before it are accepted."""
    expected, reach = 1.0, 1.0
    for alpha in acceptance[:k]:
        reach *= alpha
        expected += reach
    return expected


@dataclass(frozen=True)
class Cell:
    """One measured (batch size, k): medians over the measured steps, in milliseconds."""

    batch_size: int
    k: int
    draft_ms: float  # Propose, RPC included; about 0 at k = 0 (no call)
    target_ms: float  # Verify, RPC included
    step_ms: float  # the whole step as the coordinator saw it (coordinator work included)
    accepted_per_sequence: float  # measured mean accepted drafts per sequence and step
    ms_per_token: float  # step_ms / (batch_size × expected tokens per sequence and step)


@dataclass(frozen=True)
class Profile:
    batch_sizes: tuple[int, ...]
    max_k: int
    acceptance_by_position: tuple[float, ...]
    cells: dict[tuple[int, int], Cell]
    best_k: dict[int, int]
    created: str = ""
    hardware: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)

    # ---- what the policies ask ------------------------------------------------------------------

    def step_ms(self, batch_size: float, k: int) -> float:
        """The step time at any batch size: linear between the profiled sizes on either side;
        below the smallest, that one's; above the largest, the last segment extended (a batch
        never gets cheaper by growing). With a single profiled size: proportional beyond it."""
        return self._at_batch_size(batch_size, k, "step_ms")

    def target_ms(self, batch_size: float, k: int) -> float:
        """The Verify time of k drafts a sequence (k + 1 rows), at any batch size as ``step_ms``."""
        return self._at_batch_size(batch_size, k, "target_ms")

    def draft_ms(self, batch_size: float, k: int) -> float:
        """The Propose time of k drafts a sequence (0 at k = 0), at any batch size as ``step_ms``."""
        return self._at_batch_size(batch_size, k, "draft_ms") if k else 0.0

    def _at_batch_size(self, batch_size: float, k: int, time: str) -> float:
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return getattr(self.cells[sizes[0], k], time) * max(1.0, batch_size / sizes[0])
        if batch_size <= sizes[0]:
            return getattr(self.cells[sizes[0], k], time)
        upper = next((i for i, b in enumerate(sizes) if b >= batch_size), len(sizes) - 1)
        b0, b1 = sizes[upper - 1], sizes[upper]
        t0, t1 = getattr(self.cells[b0, k], time), getattr(self.cells[b1, k], time)
        value = t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        return max(value, t1) if batch_size > b1 else value

    def best_k_for(self, batch_size: float) -> int:
        """The paper's lookup: best k at the profiled sizes, linear in between (rounded), the
        nearest profiled size's beyond them."""
        sizes = sorted(self.best_k)
        if batch_size <= sizes[0]:
            return self.best_k[sizes[0]]
        if batch_size >= sizes[-1]:
            return self.best_k[sizes[-1]]
        upper = next(i for i, b in enumerate(sizes) if b >= batch_size)
        b0, b1 = sizes[upper - 1], sizes[upper]
        k0, k1 = self.best_k[b0], self.best_k[b1]
        return int(math.floor(k0 + (k1 - k0) * (batch_size - b0) / (b1 - b0) + 0.5))

    # ---- JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "hardware": self.hardware,
            "target": self.target,
            "draft": self.draft,
            "workload": self.workload,
            "batch_sizes": list(self.batch_sizes),
            "max_k": self.max_k,
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "table": [
                {"batch_size": c.batch_size, "k": c.k, "draft_ms": round(c.draft_ms, 3),
                 "target_ms": round(c.target_ms, 3), "step_ms": round(c.step_ms, 3),
                 "accepted_per_sequence": round(c.accepted_per_sequence, 4), "ms_per_token": round(c.ms_per_token, 4)}
                for c in sorted(self.cells.values(), key=lambda c: (c.batch_size, c.k))
            ],
            "best_k": {str(b): k for b, k in sorted(self.best_k.items())},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data, source: str = "profile") -> "Profile":
        return _parse(data, source)


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; any problem is a ProfileError naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ProfileError(f"profile {path}: cannot read it: {error.strerror or error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"profile {path}: not valid JSON: {error}") from None
    return _parse(data, f"profile {path}")


def best_k_of(ms_per_token: list[float]) -> int:
    """The smallest k whose ms_per_token (indexed by k) is within NEAR_BEST of the lowest."""
    lowest = min(ms_per_token)
    return next(k for k, ms in enumerate(ms_per_token) if ms <= lowest * (1 + NEAR_BEST))


def build_profile(batch_sizes, max_k: int, acceptance: list[float], times: dict[tuple[int, int], dict],
                  **about) -> Profile:
    """A profile from measured times per (batch size, k) and pooled acceptance per position:
    fills in ms_per_token and best_k (see the module docstring)."""
    cells = {}
    for (b, k), t in times.items():
        per_token = t["step_ms"] / (b * expected_tokens(acceptance, k))
        cells[b, k] = Cell(b, k, t["draft_ms"], t["target_ms"], t["step_ms"], t["accepted_per_sequence"], per_token)
    best = {b: best_k_of([cells[b, k].ms_per_token for k in range(max_k + 1)]) for b in batch_sizes}
    return Profile(tuple(batch_sizes), max_k, tuple(acceptance), cells, best, **about)


# ---- checking a document --------------------------------------------------------------------------

def _number(value, where: str, low: float = 0.0, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number (got {value!r})")
    if not low <= value <= high:
        raise ProfileError(f"{where} must be in [{low}, {high}] (got {value!r})")
    return float(value)


def _integer(value, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ProfileError(f"{where} must be an integer >= {low} (got {value!r})")
    return value


def _parse(data, source: str) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: the document must be a JSON object")
    if data.get("format") != FORMAT:
        raise ProfileError(f"{source}: 'format' must be {FORMAT!r} (got {data.get('format')!r})")
    if data.get("version") != VERSION:
        raise ProfileError(f"{source}: this coordinator reads profile version {VERSION} (got {data.get('version')!r})")
    missing = [key for key in ("batch_sizes", "max_k", "acceptance_by_position", "table", "best_k") if key not in data]
    if missing:
        raise ProfileError(f"{source}: missing {', '.join(missing)}")
    max_k = _integer(data["max_k"], f"{source}: max_k")
    sizes = data["batch_sizes"]
    if not isinstance(sizes, list) or not sizes:
        raise ProfileError(f"{source}: batch_sizes must be a non-empty list")
    sizes = [_integer(b, f"{source}: batch_sizes[{i}]", 1) for i, b in enumerate(sizes)]
    if sizes != sorted(set(sizes)):
        raise ProfileError(f"{source}: batch_sizes must be increasing without repeats (got {sizes})")
    acceptance = data["acceptance_by_position"]
    if not isinstance(acceptance, list) or len(acceptance) != max_k:
        raise ProfileError(f"{source}: acceptance_by_position must list max_k = {max_k} numbers")
    acceptance = [_number(a, f"{source}: acceptance_by_position[{i}]", 0.0, 1.0) for i, a in enumerate(acceptance)]
    if not isinstance(data["table"], list):
        raise ProfileError(f"{source}: table must be a list of rows")
    cells: dict[tuple[int, int], Cell] = {}
    for i, row in enumerate(data["table"]):
        where = f"{source}: table[{i}]"
        if not isinstance(row, dict):
            raise ProfileError(f"{where} must be an object")
        try:
            b, k = _integer(row["batch_size"], f"{where}.batch_size", 1), _integer(row["k"], f"{where}.k")
            times = {name: _number(row[name], f"{where}.{name}") for name in CELL_TIMES}
            accepted = _number(row["accepted_per_sequence"], f"{where}.accepted_per_sequence", 0.0, max(k, 0))
            per_token = _number(row["ms_per_token"], f"{where}.ms_per_token")
        except KeyError as error:
            raise ProfileError(f"{where} lacks {error.args[0]!r}") from None
        if b not in sizes or k > max_k:
            raise ProfileError(f"{where}: (batch_size {b}, k {k}) is outside the grid")
        if (b, k) in cells:
            raise ProfileError(f"{where}: (batch_size {b}, k {k}) appears twice")
        if times["step_ms"] <= 0:
            raise ProfileError(f"{where}.step_ms must be positive")
        cells[b, k] = Cell(b, k, times["draft_ms"], times["target_ms"], times["step_ms"], accepted, per_token)
    absent = [(b, k) for b in sizes for k in range(max_k + 1) if (b, k) not in cells]
    if absent:
        raise ProfileError(f"{source}: table lacks (batch_size, k) = {absent[:4]}{' …' if len(absent) > 4 else ''}")
    best = data["best_k"]
    if not isinstance(best, dict) or not best:
        raise ProfileError(f"{source}: best_k must be a non-empty object of batch size -> k")
    best_k = {}
    for key, k in best.items():
        try:
            b = int(key)
        except ValueError:
            raise ProfileError(f"{source}: best_k key {key!r} is not a batch size") from None
        if b < 1:
            raise ProfileError(f"{source}: best_k key {key!r} is not a batch size")
        best_k[b] = _integer(k, f"{source}: best_k[{key!r}]")
        if best_k[b] > max_k:
            raise ProfileError(f"{source}: best_k[{key!r}] = {k} exceeds max_k = {max_k}")
    about = {}
    for key in ("hardware", "target", "draft", "workload"):
        value = data.get(key, {})
        if not isinstance(value, dict):
            raise ProfileError(f"{source}: {key} must be an object")
        about[key] = value
    created = data.get("created", "")
    if not isinstance(created, str):
        raise ProfileError(f"{source}: created must be a string")
    return Profile(tuple(sizes), max_k, tuple(acceptance), cells, best_k, created=created, **about)

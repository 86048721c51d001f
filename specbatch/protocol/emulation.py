"""Emulated acceptance (``--emulate-acceptance`` on the target): per-position conditional rates at
which the target keeps drafts, for timing a pair whose drafts are never accepted (random weights).
Torch-free: the flag is checked where options are parsed, the rates reported by every program.

The value is comma-separated rates ("0.8,0.7,0.6": position j keeps its draft with probability
rates[j] given the drafts before it were kept, the last rate repeating for later positions; one
rate is the paper's i.i.d. model), or the path of a profile whose ``acceptance_by_position`` was
measured on a real pair.
"""

from __future__ import annotations

from pathlib import Path

from specbatch.protocol.profile import ProfileError, load_profile


def parse_rates(value: str) -> tuple[float, ...]:
    """The rates ``value`` names; ValueError saying what is wrong."""
    text = value.strip()
    if not text:
        raise ValueError("give rates (0.8,0.7,0.6 or 0.7) or a profile's path")
    parts = [part.strip() for part in text.split(",")]
    try:
        rates = [float(part) for part in parts]
    except ValueError:
        rates = None
    if rates is None:
        if len(parts) > 1 or not Path(text).is_file():
            raise ValueError(f"{value!r} is neither comma-separated rates in [0, 1] nor a profile file")
        try:
            rates = list(load_profile(text).acceptance_by_position)
        except ProfileError as error:  # it names the file and the field
            raise ValueError(str(error)) from None
        except OSError as error:
            raise ValueError(f"profile {text}: {error}") from None
        if not rates:
            raise ValueError(f"profile {text} has no acceptance_by_position (max_k 0)")
    bad = [r for r in rates if not 0.0 <= r <= 1.0]  # NaN fails this too
    if bad:
        raise ValueError(f"each rate must be in [0, 1] (got {', '.join(map(str, bad))})")
    return tuple(rates)


def describe(rates: tuple[float, ...] | None) -> str:
    """How the rates are reported (CacheStats, Info, results): "0.8,0.7,0.6"; empty when off."""
    return ",".join(f"{rate:g}" for rate in rates) if rates else ""


def rate_at(rates: tuple[float, ...], position: int) -> float:
    """The conditional rate at draft position ``position`` (0-based): the last one repeats."""
    return rates[min(position, len(rates) - 1)]

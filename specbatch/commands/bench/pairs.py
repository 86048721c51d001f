"""How sure ``specbatch bench``'s ratios are: modes compared round by round.

Within a round the modes run one after another on the same prompts, so the machine's drift over
minutes (several percent between runs of the same mode) moves them together; summing
rounds first, as a results row does, lets that drift into the ratio. Here each round gives one
ratio of a mode to a reference (tokens/s for uniform traffic; mean latency for the trace and
Poisson arrivals, where the arrivals set the throughput), and the rounds' log ratios give a
geometric mean with a 95 % confidence interval (Student's t over the rounds). A control mode
(``--control``: k = 0 run twice a round) measures the bench's own resolution: its ratio to k = 0
is 1 by construction, so the width of its interval is the smallest difference this run can show.
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95 % quantiles of Student's t by degrees of freedom (rounds - 1); between entries the
# next lower one is used (a slightly wider interval).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(degrees: int) -> float:
    if degrees < 1:
        return math.inf
    return _T975[max(d for d in _T975 if d <= degrees)] if degrees <= 60 else 1.96


def paired_ratio(values: list[float], reference: list[float]) -> dict:
    """Round by round ``values[i] / reference[i]``: their geometric mean and its 95 % interval
    (``low``/``high``; infinite with one round). Rounds where either is 0 or missing are left out."""
    logs = [math.log(v / r) for v, r in zip(values, reference) if v > 0 and r > 0]
    if not logs:
        return {"ratio": math.nan, "low": math.nan, "high": math.nan, "rounds": 0}
    mean = statistics.fmean(logs)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "rounds": len(logs)}


def higher_is_better(traffic: str) -> bool:
    """Uniform traffic compares throughput; the trace and Poisson arrivals compare mean latency."""
    return traffic == "uniform"


def compare(traffic: str, per_round: dict[str, list[float]], fixed: list[str], others: list[str],
            control: tuple[str, str] | None = None) -> list[dict]:
    """Each of ``others`` (the policies) against the best of ``fixed`` (chosen on the rounds' mean
    metric), round by round; and the control against its twin. ``per_round``: mode -> the metric
    in each round. A ratio above 1 means better than the reference (for latency, the reference's
    latency over the mode's)."""
    better = higher_is_better(traffic)

    def oriented(mode: str) -> list[float]:
        return per_round[mode] if better else [1 / v if v > 0 else 0.0 for v in per_round[mode]]

    best = max(fixed, key=lambda m: statistics.fmean(oriented(m)))
    rows = [{"mode": m, "reference": best, **paired_ratio(oriented(m), oriented(best))} for m in others]
    if control is not None:
        twin, of = control
        rows.append({"mode": twin, "reference": of, **paired_ratio(oriented(twin), oriented(of))})
    return rows


def markdown(comparisons: list[dict]) -> str:
    """The comparisons as a table: ratio, interval and what the interval says about 2 %."""
    lines = ["| traffic | mode | against | ratio | 95 % interval | rounds | within 2 % of it? |", "|---" * 7 + "|"]
    for c in comparisons:
        if c["rounds"] < 2:
            verdict = "one round: no interval"
        elif c["low"] >= 0.98:
            verdict = "yes"
        elif c["high"] < 0.98:
            verdict = "no, below it"
        else:
            verdict = "not resolved"
        lines.append(f"| {c['load']} | {c['mode']} | {c['reference']} | {c['ratio']:.3f} | "
                     f"{c['low']:.3f} – {c['high']:.3f} | {c['rounds']} | {verdict} |")
    return "\n".join(lines)

"""`specbatch bench-engine`'s report as markdown: ms per verify step and per drafted token over
batch size x tokens (or k), each beside its bandwidth limit. Torch-free, so the results pages
render it too."""

from __future__ import annotations


def _ms(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"  # tiny limits keep two digits


def _with_limit(ms: float, limit: float | None) -> str:
    return _ms(ms) + (f" ({_ms(limit)})" if limit is not None else "")


def _table(title: str, rows: list[dict], column: str, header: str, columns: list[int], batch_sizes: list[int],
           value: str, limit: str) -> list[str]:
    """One markdown table: a row per batch size, a column per value of ``column``."""
    cells = {(c["batch_size"], c[column]): c for c in rows}
    lines = [title, "", f"| batch \\ {header} | " + " | ".join(str(x) for x in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for b in batch_sizes:
        lines.append(f"| {b} | " + " | ".join(_with_limit(cells[b, x][value], cells[b, x][limit]) for x in columns) + " |")
    return lines


def _form(about: dict) -> str:
    """The model's dtype, and its weight form where the CPU kernels run one (older reports name none)."""
    weights = about.get("weights")
    return about["dtype"] + (f", weights {weights}" if weights not in (None, "model") else "")


def markdown(report: dict) -> str:
    grid = report["grid"]
    target = report["target"]
    lines = _table(f"ms per verify step (bandwidth limit), context {grid['context']}, target {target['model']} "
                   f"({_form(target)}):", report["verify"], "tokens", "tokens per sequence", grid["tokens"], grid["batch_sizes"],
                   "ms", "limit_ms")
    if report["draft"]:
        draft = report["draft_model"]
        lines += [""] + _table(f"ms per drafted token (bandwidth limit), draft {draft['model']} ({_form(draft)}):",
                               report["draft"], "k", "k", grid["ks"], grid["batch_sizes"], "ms_per_token",
                               "limit_ms_per_token")
    lines += ["", f"bandwidth: {report['bandwidth_gbs']} GB/s ({report['bandwidth_source']}); median of "
              f"{grid['repeats']} calls after {grid['warmup']} warm-up calls"]
    for role, about in (("target", target), ("draft", report.get("draft_model"))):
        if about and about.get("captured_steps"):
            capture = about.get("capture")
            lines.append(f"captured steps of the {role}: {about['captured_steps']}" + (
                f" ({capture['graphs']} CUDA graphs captured in {capture['seconds']} s, +{capture['allocated_mib']} MiB "
                f"allocated, +{capture['reserved_mib']} MiB reserved)" if capture else ""))
    return "\n".join(lines)

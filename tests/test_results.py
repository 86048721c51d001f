"""Results as files (specbatch/commands/results.py): the stamp every result carries, where write()
puts it, and the pages and README table rendered from them."""

from __future__ import annotations

import json

import pytest

from specbatch.commands import results


def bench_row(mode: str, concurrency: int, tokens_per_s: float) -> dict:
    """A row of ``specbatch bench``'s results, as its report writes it."""
    stats = {"mean": 1.0, "p50": 1.0, "p99": 2.0}
    return {"traffic": "uniform", "load": f"uniform c={concurrency}", "value": concurrency, "mode": mode,
            "requests": 4, "errors": {}, "tokens": 256, "seconds": 1.0, "tokens_per_s": tokens_per_s,
            "ttft_ms": stats, "tpot_ms": stats, "latency_s": stats, "acceptance": None if mode.startswith("k=0") else 0.5,
            "mean_k": 0.0, "k_share": {"0": 1.0}, "tokens_per_step": 1.0, "batch": float(concurrency), "step_ms": 5.0,
            "draft_ms": 0.0, "target_ms": 4.0, "other_ms": 1.0, "per_round": [tokens_per_s], "timeline": []}


def fake_result(machine: str, kind: str, **payload) -> dict:
    return {"kind": kind, "machine": machine, "date": "2026-01-02T03:04:05+00:00", "commit": "0123456789abcdef",
            "dirty": False, "hardware": {"cpu": "Test CPU", "cores": 2, "flags": ["avx2"], "torch": "0.0"}, **payload}


def test_the_stamp_names_the_machine_the_date_and_the_commit():
    stamp = results.stamp("cpu")
    assert stamp["machine"] == results.machine_slug(stamp["hardware"]) and stamp["machine"].endswith("c")
    assert stamp["date"].startswith("20") and stamp["date"].endswith("+00:00")
    if (results.ROOT / ".git").exists():  # this checkout's HEAD, and whether its tracked files differ
        assert len(stamp["commit"]) == 40 and stamp["dirty"] in (True, False)
    else:
        assert stamp["commit"] and stamp["dirty"] is None
    assert {"cpu", "cores", "flags"} <= set(stamp["hardware"]) and "gpu" not in stamp["hardware"]


def test_machine_slugs_are_short_and_stable():
    slug = results.machine_slug
    assert slug({"cpu": "AMD EPYC 9R14 96-Core Processor", "cores": 2,
                 "flags": ["avx2", "avx512f", "avx512_bf16"]}) == "amd-epyc-avx512-bf16-2c"
    assert slug({"cpu": "Intel(R) Xeon(R) Platinum 8488C", "cores": 2,
                 "flags": ["avx2", "avx512f", "avx512_bf16", "avx512_fp16"]}) == "intel-xeon-avx512-fp16-2c"
    assert slug({"cpu": "AMD EPYC", "cores": 2, "flags": ["avx2"]}) == "amd-epyc-avx2-2c"
    assert slug({"cpu": "Intel(R) Xeon(R) Processor", "cores": 16, "gpu": "NVIDIA H200"}) == "nvidia-h200"
    assert slug({"gpu": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100"


def test_an_emulated_cpu_form_is_named_so(monkeypatch):
    """A run with flags withheld (SPECBATCH_CPU_WITHOUT) is filed apart from a CPU of that form."""
    monkeypatch.setenv("SPECBATCH_CPU_WITHOUT", "avx512,amx")
    info = results.hardware("cpu")
    assert info["emulated_without"] == ["avx512", "amx"]
    assert not any(flag.startswith(("avx512", "amx")) for flag in info["flags"])
    assert results.machine_slug(info).endswith("-emulated-" + f"{info['cores']}c")
    assert "emulated: this CPU's avx512*, amx* flags left unused" in results._hardware_line(info)
    monkeypatch.delenv("SPECBATCH_CPU_WITHOUT")
    assert "emulated_without" not in results.hardware("cpu") and "emulated" not in results.stamp("cpu")["machine"]


def test_write_puts_the_result_where_it_says(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_RESULTS", str(tmp_path / "results"))
    path = results.write("bench", {"rows": [1, 2]}, device="cpu")
    machine = results.stamp("cpu")["machine"]
    assert path == tmp_path / "results" / machine / "bench.json"
    document = json.loads(path.read_text())
    assert document["kind"] == "bench" and document["rows"] == [1, 2] and document["machine"] == machine
    assert {"date", "commit", "dirty", "hardware"} <= set(document)
    variant = results.write("bench", {"rows": [3]}, variant="tiny", device="cpu")
    assert variant.name == "bench-tiny.json" and json.loads(variant.read_text())["variant"] == "tiny"
    explicit = results.write("soak", {"levels": []}, out=tmp_path / "elsewhere" / "soak.json", device="cpu")
    assert explicit == tmp_path / "elsewhere" / "soak.json" and json.loads(explicit.read_text())["kind"] == "soak"
    assert results.write("bench", {"rows": [4]}, device="cpu") == path  # the newest replaces the older
    assert json.loads(path.read_text())["rows"] == [4]


def test_two_machines_render_into_two_pages_and_the_readme_table(tmp_path):
    folder = tmp_path / "results"
    rows = {"cpu-a-2c": [("k=0 (target only)", 1, 20.0), ("goodput", 1, 25.0), ("k=0 (target only)", 8, 80.0),
                         ("goodput", 8, 72.0)],
            "gpu-b": [("k=0 (target only)", 1, 300.0), ("profile", 1, 330.0)]}
    for machine, modes in rows.items():
        (folder / machine).mkdir(parents=True)
        bench = fake_result(machine, "bench", default_policy="goodput" if machine == "cpu-a-2c" else None,
                            rows=[bench_row(*mode) for mode in modes], comparisons=[])
        (folder / machine / "bench.json").write_text(json.dumps(bench))
    (folder / "cpu-a-2c" / "threads.json").write_text(json.dumps(fake_result(
        "cpu-a-2c", "threads", rows=[{"setting": "auto", "threads": 1, "quiet": 1.5, "busy": 2.0, "same": True}])))
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nBefore.\n\n<!-- results:begin -->\nold table\n<!-- results:end -->\n\nAfter.\n")
    docs = tmp_path / "docs" / "results"

    pages = results.render_all(folder, docs, readme)

    assert set(pages) == {"cpu-a-2c", "gpu-b"}
    page = (docs / "cpu-a-2c.md").read_text()
    assert page.startswith(results.GENERATED) and "# Results: cpu-a-2c" in page and "0123456789" in page
    assert "## bench" in page and "## threads" in page and "| uniform c=8 | goodput |" in page
    assert (docs / "cpu-a-2c" / "bench-uniform.png").read_bytes()[:4] == b"\x89PNG"
    assert "bench-uniform.png" in page
    text = readme.read_text()
    assert text.startswith("# Project\n\nBefore.\n\n<!-- results:begin -->\n") and text.endswith(
        "<!-- results:end -->\n\nAfter.\n")
    assert "old table" not in text
    assert "| [cpu-a-2c](docs/results/cpu-a-2c.md) | 20.0 | 25.0 (goodput) | 1.25× | 80.0 | 72.0 (goodput) | 0.90× |" in text
    assert "| [gpu-b](docs/results/gpu-b.md) | 300.0 | 330.0 (profile) | 1.10× | – | – | – |" in text
    results.render_all(folder, docs, readme)  # again: the same block, replaced, not added
    assert readme.read_text().count("<!-- results:begin -->") == 1


def test_the_readme_headline_is_the_embedded_pairs_bench():
    """A bench of another pair (random weights, emulated acceptance) sorts first by name but is
    left to the machine's page: the README row is the embedded pair's, or dashes where none ran."""
    real = fake_result("m", "bench", _name="bench", default_policy="learn", args={"target_model": None},
                       rows=[bench_row("k=0 (target only)", 1, 100.0), bench_row("learn", 1, 120.0)])
    emulated = fake_result("m", "bench", _name="bench-a-serve-opt", default_policy="learn",
                           args={"target_model": "opt-6.7b", "random_weights": True, "emulate_acceptance": "0.7"},
                           rows=[bench_row("k=0 (target only)", 1, 50.0), bench_row("learn", 1, 90.0)])
    assert results.headline([emulated, real])[:3] == ["100.0", "120.0 (learn)", "1.20×"]
    assert results.headline([emulated]) == ["–"] * 6


def test_a_named_commit_is_the_copys_own(monkeypatch):
    """A tree copied to another machine may carry a .git that is not its own: SPECBATCH_COMMIT wins."""
    monkeypatch.setenv("SPECBATCH_COMMIT", "feedface" * 5)
    stamp = results.stamp("cpu")
    assert stamp["commit"] == "feedface" * 5 and stamp["dirty"] is None


def test_a_readme_without_the_markers_is_left_alone(tmp_path, capsys):
    (tmp_path / "results" / "m").mkdir(parents=True)
    (tmp_path / "results" / "m" / "soak.json").write_text(json.dumps(fake_result("m", "soak")))
    readme = tmp_path / "README.md"
    readme.write_text("no block here\n")
    results.render_all(tmp_path / "results", tmp_path / "docs", readme)
    assert readme.read_text() == "no block here\n" and "no <!-- results:begin -->" in capsys.readouterr().err


@pytest.mark.parametrize("result", [
    fake_result("m", "a-kind-nobody-knows", numbers=list(range(100)), nested={"a": {"b": {"c": {"d": 1}}}}),
    fake_result("m", "bench", rows="not rows"),  # a known kind in a layout its renderer does not read
    {"no": "stamp at all"},
])
def test_any_result_renders_without_crashing(tmp_path, result):
    (tmp_path / "results" / "m").mkdir(parents=True)
    (tmp_path / "results" / "m" / "x.json").write_text(json.dumps(result))
    (tmp_path / "results" / "m" / "broken.json").write_text("{not json")
    results.render_all(tmp_path / "results", tmp_path / "docs")
    page = (tmp_path / "docs" / "m.md").read_text()
    assert "## x" in page and "## broken" in page and "```json" in page


def test_a_profile_is_summarised_as_a_result():
    from test_profile import gpu_like, synthetic_profile

    from specbatch.commands.profiler import summary

    profile = synthetic_profile(gpu_like, [0.8, 0.7, 0.6])
    result = json.loads(json.dumps(summary(profile, "p.json")))
    assert result["batch_sizes"] == [1, 2, 4, 8, 16, 32] and len(result["acceptance_by_position"]) == 3
    assert result["best_k"] == {str(b): k for b, k in profile.best_k.items()}
    assert "| 1 | " in results.render({**result, "kind": "profile", "_name": "profile"}, None)

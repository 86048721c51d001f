"""``specbatch bench-engine`` on CPU with tiny random shapes and a tiny grid."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from test_random_weights import tiny_shape

from specbatch.commands import cli
from specbatch.commands.bench.engine import (
    CPU_BANDWIDTH_GBS,
    Grid,
    Traffic,
    bench_engine,
    default_bandwidth_gbs,
    limit_ms,
)
from specbatch.engine.engine import Engine
from specbatch.kernels import build
from specbatch.models.loading import ModelSpec, load_model


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-shapes")
    return tiny_shape(root / "target", "opt", layers=2), tiny_shape(root / "draft", "llama", layers=1, hidden=32)


def engine_of(folder: str, budget: int | None = None) -> Engine:
    return Engine(load_model(ModelSpec(folder, random_weights=True), "cpu", "float32"), max_sequences=4,
                  max_context=40, max_cache_bytes=budget)


def test_every_cell_at_a_fixed_context(shapes):
    """Every (batch, tokens) and (batch, k) cell is measured; every timed call keeps exactly the
    context, so no call sees more than the grid's context; all sequences are released after."""
    target, draft = engine_of(shapes[0]), engine_of(shapes[1])
    kept = []
    for engine in (target, draft):
        original = engine.start

        def spy(inputs, *args, _original=original, **kwargs):
            kept.extend(item.keep_len for item in inputs)
            return _original(inputs, *args, **kwargs)

        engine.start = spy
    grid = Grid((1, 3), (1, 4), (1, 2), context=16, repeats=2, warmup=1)
    result = bench_engine(target, draft, grid, bandwidth_gbs=10.0)
    assert [(c["batch_size"], c["tokens"]) for c in result["verify"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert [(c["batch_size"], c["k"]) for c in result["draft"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    assert all(c["ms"] > 0 and c["limit_ms"] > 0 for c in result["verify"])
    assert all(c["ms_per_token"] == pytest.approx(c["ms"] / c["k"], abs=2e-3) for c in result["draft"])
    assert set(kept) == {0, 16}  # prefill, then every timed call at the context
    assert not target.sequences and not draft.sequences


def test_bandwidth_limit_counts_weights_once_and_every_kv_token(shapes):
    engine = engine_of(shapes[0])
    traffic = Traffic.of(engine)
    model = engine.model
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied: the head reads it, once
    assert traffic.weight_bytes == 4 * sum(p.numel() for p in model.parameters())
    layers, kv_heads, head_dim = engine.kv_shape
    assert traffic.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 4
    assert limit_ms(traffic.forward_bytes(2, 10), 1.0) == pytest.approx(
        (traffic.weight_bytes + 20 * traffic.kv_bytes_per_token) / 1e9 * 1e3)
    untied = engine_of(shapes[1])  # Llama shape, untied: the input embedding is a lookup
    embedding = untied.model.get_input_embeddings().weight
    assert Traffic.of(untied).weight_bytes == 4 * (sum(p.numel() for p in untied.model.parameters()) - embedding.numel())


def test_default_bandwidth_by_device_name(monkeypatch):
    assert default_bandwidth_gbs(torch.device("cpu"))[0] == CPU_BANDWIDTH_GBS
    for name, gbs in (("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H200", 4800.0),
                      ("NVIDIA A100-SXM4-80GB", 2039.0), ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, _name=name: _name)
        assert default_bandwidth_gbs(torch.device("cuda"))[0] == gbs


def test_command_writes_json_with_every_cell_and_markdown(shapes, tmp_path, capsys):
    out = tmp_path / "bench"
    code = cli.main(["bench-engine", "--target-model", shapes[0], "--draft-model", shapes[1], "--random-weights",
                     "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2", "--tokens", "1,3", "--ks", "1,2",
                     "--context", "8", "--repeats", "1", "--warmup", "0", "--bandwidth-gbs", "20", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench-engine.json").read_text())
    assert report["format"] == "specbatch-bench-engine" and report["bandwidth_gbs"] == 20
    assert report["kind"] == "bench-engine" and {"machine", "date", "commit"} <= set(report)  # a stamped result
    assert {(c["batch_size"], c["tokens"]) for c in report["verify"]} == {(b, t) for b in (1, 2) for t in (1, 3)}
    assert {(c["batch_size"], c["k"]) for c in report["draft"]} == {(b, k) for b in (1, 2) for k in (1, 2)}
    assert report["target"]["random_weights"] and report["target"]["dtype"] == "float32"
    printed = capsys.readouterr().out
    assert "| batch \\ tokens per sequence | 1 | 3 |" in printed and "| batch \\ k | 1 | 2 |" in printed
    assert (out / "bench-engine.md").read_text().strip() == printed.strip()


@pytest.mark.skipif(not build.blocks_available(), reason="the GGUF block kernels did not build here")
def test_on_a_cpu_the_engines_are_built_as_the_services_build_them(shapes, tmp_path):
    """A named CPU form (here Q8_0 blocks) runs on both engines, with keys and values in bf16 and
    the draft on the target's model thread; the bandwidth limit counts the packed weights a
    forward reads; the caller's thread count is left as it was."""
    threads = torch.get_num_threads()
    built = []
    original = Engine.__post_init__

    def spy(engine):
        original(engine)
        built.append(engine)

    with mock.patch.object(Engine, "__post_init__", spy):
        code = cli.main(["bench-engine", "--target-model", shapes[1], "--draft-model", shapes[1], "--random-weights",
                         "--device", "cpu", "--weights", "q8_0", "--batch-sizes", "1", "--tokens", "1,2", "--ks", "1",
                         "--context", "8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0 and torch.get_num_threads() == threads
    target, draft = built
    assert target.weights == draft.weights == "q8_0" and target.kv_bf16 and draft.kv_bf16
    assert draft.model_thread is target.model_thread and target.forward.wide_threads >= 1
    report = json.loads((tmp_path / "bench-engine.json").read_text())
    assert report["target"]["weights"] == report["draft_model"]["weights"] == "q8_0"
    float32_bytes = 4 * sum(p.numel() for p in target.model.parameters())
    assert 0 < report["target"]["weight_bytes_read"] < float32_bytes / 3  # 9 bits a weight, not 32
    assert "weights q8_0" in (tmp_path / "bench-engine.md").read_text()
    # a form the model cannot run is refused, as the services refuse it
    assert cli.main(["bench-engine", "--target-model", shapes[0], "--random-weights", "--device", "cpu",
                     "--weights", "q4_1", "--batch-sizes", "1", "--tokens", "1", "--context", "8"]) == 2


def test_command_skips_batch_sizes_over_the_kv_budget(shapes, tmp_path, capsys):
    # 2 layers x 2 x 4 heads x 16 x 4 bytes = 1 KiB per token; 8 + 2 + 1 columns: 11 KiB a sequence.
    code = cli.main(["bench-engine", "--target-model", shapes[0], "--random-weights", "--device", "cpu",
                     "--batch-sizes", "1,2,64", "--tokens", "1,2", "--ks", "1", "--context", "8", "--repeats", "1",
                     "--warmup", "0", "--kv-cache-gb", str(40 * 2**10 / 2**30), "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench-engine.json").read_text())
    assert report["skipped_batch_sizes"] == [64] and report["grid"]["batch_sizes"] == [1, 2]
    assert report["draft"] == [] and report["draft_model"] is None
    assert "do not fit" in capsys.readouterr().err


def test_command_refuses_a_bad_grid(shapes):
    assert cli.main(["bench-engine", "--target-model", shapes[0], "--random-weights", "--batch-sizes", "4,2"]) == 2
    assert cli.main(["bench-engine", "--target-model", shapes[0], "--random-weights", "--context", "300"]) == 2

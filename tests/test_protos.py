"""The committed generated code matches what protoc makes from protos/ now."""

from pathlib import Path

from specbatch.protocol.generate import ROOT, generate


def test_generated_code_is_current(tmp_path: Path):
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / "specbatch" / "v1" / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale; run `make protos`"

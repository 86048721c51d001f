"""The specbatch command against an in-process stack."""

from specbatch.commands import cli


def test_generate_text_prompt_streams_text(stack, capsys):
    code = cli.main(["generate", "w5 w6 w7", "--max-new-tokens", "6", "--ignore-eos", "--address", stack.address])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed text
    assert "[length] 6 tokens" in captured.err


def test_generate_reports_bad_input(stack, capsys):
    code = cli.main(["generate", "w5", "--max-new-tokens", "0", "--address", stack.address])
    assert code == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_bench_prints_both_modes(stack, capsys, tmp_path):
    code = cli.main(["bench", "--address", stack.address, "--concurrency", "1,2", "--requests", "2",
                     "--max-new-tokens", "8", "--k", "2", "--prompts", "chat", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| uniform c=1 |") or line.startswith("| uniform c=2 |")]
    assert len(rows) == 8  # 2 levels x 2 modes, in the latency table and the step-split table
    assert any("| k=0 (target only) |" in r for r in rows) and any("| k=2 |" in r for r in rows)

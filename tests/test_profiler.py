"""``specbatch profile`` end to end on a tiny in-process stack, and what its measurement means."""

from __future__ import annotations

import copy

from test_exactness import prompts_of_lengths

from specbatch.commands import cli
from specbatch.commands.profiler import Sweep, measure, powers_of_two
from specbatch.protocol.profile import load_profile
from specbatch.stack.in_process import start_local_stack


def test_profile_command_writes_profile_table_and_heatmap(stack, tokenizer, tmp_path, capsys):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "profile.json"
    code = cli.main(["profile", "--target", f"127.0.0.1:{stack.target.port}", "--draft", f"127.0.0.1:{stack.draft.port}",
                     "--tokenizer", str(tmp_path / "tokenizer"), "--batch-sizes", "1,3", "--max-k", "2",
                     "--steps", "2", "--warmup-steps", "1", "--max-prompt-tokens", "64", "--out", str(out),
                     "--hardware", "a test"])
    assert code == 0
    profile = load_profile(out)
    assert profile.batch_sizes == (1, 3) and profile.max_k == 2
    assert set(profile.best_k) == {1, 3} and all(0 <= k <= 2 for k in profile.best_k.values())
    assert profile.target["model"] == "target" and profile.draft["model"] == "draft"
    assert profile.hardware["description"] == "a test" and profile.created
    assert profile.workload["first_conversation"] == 16000
    for (b, k), cell in profile.cells.items():
        assert cell.step_ms > 0 and cell.target_ms > 0
        assert cell.draft_ms > 0.1 if k else cell.draft_ms < 0.1  # k = 0: no Propose call
        assert cell.step_ms >= cell.target_ms
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| batch | k=0 | k=1 | k=2 | best k |" in printed and "acceptance by draft position" in printed
    # Every profiled sequence was released on both services.
    assert not stack.target_engine.sequences and not stack.draft_engine.sequences


def test_measurement_batch_sizes_and_acceptance(target_model, tokenizer):
    """With the target as its own draft every draft is accepted: acceptance 1 at every position,
    k accepted per sequence and step; and a batch size is exactly what was asked for."""
    stack = start_local_stack(target_model, copy.deepcopy(target_model), tokenizer)
    seen = []
    original = stack.target_engine.start

    def spy(inputs, *args, **kwargs):
        seen.append(len(inputs))
        return original(inputs, *args, **kwargs)

    stack.target_engine.start = spy
    try:
        from coordinator.backends import DraftClient, TargetClient

        target = TargetClient(f"127.0.0.1:{stack.target.port}", 60)
        draft = DraftClient(f"127.0.0.1:{stack.draft.port}", 60)
        visits = []
        sweep = Sweep([1, 4], 3, steps=3, warmup_steps=1, rounds=2)
        times, acceptance = measure(target, draft, tokenizer, prompts_of_lengths([5, 9, 13]), sweep,
                                    progress=lambda what, done: visits.append(what))
        assert acceptance == [1.0, 1.0, 1.0]
        # Round-robin: each batch size visits k = 0 … 3 twice, 1 warm-up + 2 then 1 + 1 measured steps.
        cells = [f"batch {b:>3}, k={k}" for b in (1, 4) for k in (0, 1, 2, 3)]
        expected = [cell for b in (0, 4) for n in (3, 2) for cell in cells[b : b + 4] for _ in range(n)]
        assert visits == expected and len(visits) == 2 * 4 * sweep.steps_per_k()
        for (b, k), cell in times.items():
            assert cell["accepted_per_sequence"] == k
        assert set(seen) == {1, 4}  # every verify call: exactly one of the asked batch sizes
    finally:
        stack.stop()


def test_sweep_shares_the_measured_steps_out_over_its_rounds():
    assert Sweep([1], 2, steps=10, rounds=4).visits() == [3, 3, 2, 2]
    assert Sweep([1], 2, steps=2, rounds=4).visits() == [1, 1]  # never an empty visit
    assert Sweep([1], 2, steps=16, warmup_steps=1, rounds=4).steps_per_k() == 20
    assert Sweep([1], 2, steps=16, warmup_steps=1, rounds=4).growth() == 20 * (1 + 2 + 3)


def test_default_batch_sizes():
    assert powers_of_two(32) == [1, 2, 4, 8, 16, 32]
    assert powers_of_two(12) == [1, 2, 4, 8, 12]
    assert powers_of_two(1) == [1]

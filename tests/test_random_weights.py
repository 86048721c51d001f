"""Models of any shape with random weights (--random-weights), and a profile that combines measured
step times with a given acceptance (--acceptance, --acceptance-from)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, greedy_reference
from transformers import AutoConfig

from specbatch.cache import cache_root
from specbatch.commands import cli
from specbatch.commands.profiler import given_acceptance
from specbatch.config.options import parser_for
from specbatch.engine.batch import SequenceInput
from specbatch.engine.engine import Engine
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT
from specbatch.models.loading import ModelSpec, chat_token_ids, load_model, load_tokenizer
from specbatch.models.random_weights import KNOWN_CONFIGS, fit_vocab, random_config, random_model, tokenizer_source
from specbatch.protocol.profile import best_k_of, expected_tokens, load_profile
from specbatch.rpc.client import connect, generate, make_request
from specbatch.stack.defaults import StackOptions, free_port
from specbatch.stack.processes import LocalProcesses
from target_service.verifier import VerifyItem, verify


def tiny_shape(folder, model_type: str = "llama", layers: int = 2, hidden: int = 64, tokenizer=None) -> str:
    """A config folder of a tiny shape (and a tokenizer, if given): what --random-weights reads."""
    shapes = {"llama": dict(intermediate_size=2 * hidden, num_key_value_heads=2, max_position_embeddings=256),
              "opt": dict(ffn_dim=2 * hidden, word_embed_proj_dim=hidden, max_position_embeddings=256)}
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=4, **shapes[model_type])
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


# ---- the shapes -------------------------------------------------------------------------------------

def test_known_shapes_are_the_published_ones():
    opt = random_config("facebook/opt-6.7b")
    assert (opt.model_type, opt.hidden_size, opt.num_hidden_layers, opt.num_attention_heads, opt.ffn_dim,
            opt.vocab_size, opt.max_position_embeddings) == ("opt", 4096, 32, 32, 16384, 50272, 2048)
    small = random_config("opt-125m")
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.ffn_dim) == (768, 12, 12, 3072)
    llama = random_config("llama-3-8b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads, llama.intermediate_size,
            llama.vocab_size, llama.rope_parameters["rope_theta"]) == (4096, 32, 8, 14336, 128256, 500000.0)


def kv_memory_script():
    """benchmarks/kv_memory.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("kv_memory", Path(__file__).parents[1] / "benchmarks/kv_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_3_8b_drafts_are_the_published_shapes():
    """Llama-3.2-1B (1.24 B parameters, its head tied) and a one-layer EAGLE-style head over
    Llama-3-8B's features, counted on the meta device as the KV report counts them."""
    kv_memory = kv_memory_script()
    one_b = kv_memory.shape_of("meta-llama/Llama-3.2-1B", torch.bfloat16)
    assert abs(one_b["parameters"] - 1.236e9) < 0.01e9 and one_b["kv_bytes_per_token"] == 16 * 2 * 8 * 64 * 2
    eight_b = kv_memory.shape_of("llama-3-8b", torch.bfloat16)
    assert abs(eight_b["parameters"] - 8.03e9) < 0.01e9 and eight_b["kv_bytes_per_token"] == 128 * 1024
    head = random_config("llama-3-8b-eagle")
    assert (head.model_type, head.num_hidden_layers, head.hidden_size, head.feature_size, head.vocab_size,
            head.draft_vocab_size) == ("specbatch_eagle", 1, 4096, 4096, 128256, 32768)


def test_the_kv_report_counts_slots_and_pages(tmp_path):
    """At 80 GiB a Llama-3-8B target with its 1B draft holds well over 64 sequences at 2k tokens
    in the pool's slots (not paged), fewer at 8k, where pages of what sequences wrote hold more."""
    kv_memory = kv_memory_script()
    report = kv_memory.main(["--gib", "80", "--out", str(tmp_path / "kv.json")])
    at = {row["context"]: row for row in report["rows"]}
    per_sequence = (128 + 32) * 1024 * 2049  # both models' keys and values, a slot of 2k + 1 columns
    free = (80 - report["weights_gib"] - 4.0) * 2**30
    assert at[2048]["pool_sequences"] == int(free // per_sequence) and at[2048]["pool_sequences"] >= 64
    assert not at[2048]["page_it"] and at[8192]["pool_sequences"] < at[2048]["pool_sequences"] // 3
    assert at[8192]["paged_sequences"] > at[8192]["pool_sequences"]
    assert json.loads((tmp_path / "kv.json").read_text())["kind"] == "kv-memory"


def test_smollm2_shape_is_the_embedded_models_config():
    embedded = cache_root() / "models" / EMBEDDED / "config.json"
    if not embedded.exists():
        pytest.skip("the embedded model has not been converted on this machine")
    real = json.loads(embedded.read_text())
    for key, value in KNOWN_CONFIGS["smollm2-135m"].items():
        # The converted GGUF stores its floats in float32 (rms_norm_eps 9.9999997e-06).
        assert math.isclose(real[key], value, rel_tol=1e-6) if isinstance(value, float) else real[key] == value, key


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="opt-6.7b"):
        random_config("no-such-model")


def test_the_embedded_eagle_draft_has_a_random_form():
    """Its shipped config's shape (one layer, an 8192-token head over the first 8192 ids), random
    and finite, reading target features of the embedded target's width."""
    draft = random_model(EMBEDDED_DRAFT, "cpu", torch.float32)
    config = draft.config
    assert type(draft).__name__ == "EagleDraftForCausalLM" and config.num_hidden_layers == 1
    assert torch.equal(draft.draft_to_target, torch.arange(config.draft_vocab_size))
    assert draft.lm_head.weight.shape == (config.draft_vocab_size, config.hidden_size)
    assert 0.015 < float(draft.lm_head.weight.std()) < 0.025
    features = torch.randn(1, 4, config.feature_size)
    logits = draft(input_ids=torch.tensor([[5, 6, 7, 8]]), target_features=features).logits
    assert logits.shape == (1, 4, config.draft_vocab_size) and bool(torch.isfinite(logits).all())


def test_random_model_is_small_finite_seeded_and_on_the_device(tmp_path):
    folder = tiny_shape(tmp_path / "shape", "opt")
    model = random_model(folder, "cpu", torch.bfloat16)
    assert type(model).__name__ == "OPTForCausalLM" and model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as the config says
    matrices = [p.float() for p in model.parameters() if p.dim() == 2]
    assert all(0.015 < m.std() < 0.025 for m in matrices)
    norms = [p for name, p in model.named_parameters() if p.dim() == 1 and name.endswith("weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert bool(torch.isfinite(logits).all())
    again = random_model(folder, "cpu", torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("model_type", ["llama", "opt"])
def test_random_shape_through_the_engine(tmp_path, model_type):
    """Greedy verify through the engine equals the model's own greedy decoding."""
    folder = tiny_shape(tmp_path / "shape", model_type)
    model = load_model(ModelSpec(folder, random_weights=True), "cpu", "float32")
    engine = Engine(model, max_sequences=4)
    prompt = [3, 17, 40, 9]
    reference = greedy_reference(model, prompt, 4)
    verdict = engine.run(verify, engine, [VerifyItem(SequenceInput("s", 0, prompt), reference[:3])], True)[0]
    assert (verdict.accepted, verdict.next_token) == (3, reference[3])


def test_tokenizer_for_random_weights(tmp_path, tokenizer):
    with_tokenizer = tiny_shape(tmp_path / "with", tokenizer=tokenizer)
    assert tokenizer_source(with_tokenizer) == with_tokenizer
    assert tokenizer_source(tiny_shape(tmp_path / "without")) == EMBEDDED
    assert tokenizer_source("opt-6.7b") == EMBEDDED
    loaded = load_tokenizer(ModelSpec(with_tokenizer, random_weights=True))
    assert loaded.encode("w1 w2", add_special_tokens=False) == tokenizer.encode("w1 w2", add_special_tokens=False)
    assert fit_vocab([5, 96, 200], 96) == [5, 0, 8]


def test_flags_reach_the_services():
    args = parser_for("target").parse_args(["--model", "opt-6.7b", "--random-weights"])
    assert args.random_weights and args.model == "opt-6.7b"
    stack = LocalProcesses(StackOptions(random_weights=True, kv_cache_gb=40.0, target_model="opt-125m"))
    flags = stack._service_flags("target", "opt-125m", None, "model")
    assert "--random-weights" in flags and flags[flags.index("--kv-cache-gb") + 1] == "40.0"
    assert ModelSpec("opt-125m", random_weights=True).describe() == "opt-125m [random weights]"


# ---- given acceptance -------------------------------------------------------------------------------

def test_given_acceptance(tmp_path):
    assert given_acceptance(None, None, 3) is None
    assert given_acceptance("0.8, 0.7,0.6,0.5", None, 3) == [0.8, 0.7, 0.6]
    with pytest.raises(ValueError, match="--max-k 3 needs 3"):
        given_acceptance("0.8,0.7", None, 3)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        given_acceptance("0.8,1.7", None, 2)
    with pytest.raises(ValueError, match="comma-separated"):
        given_acceptance("0.8,x", None, 2)


def test_profile_with_given_acceptance(stack, tokenizer, tmp_path, capsys):
    """Measured step times, the given acceptance: ms per token and best k follow from both, and the
    measured acceptance is kept beside it; a profile's acceptance can be taken by another."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    common = ["--target", f"127.0.0.1:{stack.target.port}", "--draft", f"127.0.0.1:{stack.draft.port}",
              "--tokenizer", str(tmp_path / "tokenizer"), "--batch-sizes", "1,2", "--max-k", "2", "--steps", "2",
              "--warmup-steps", "1", "--max-prompt-tokens", "64"]
    first = tmp_path / "given.json"
    assert cli.main(["profile", *common, "--acceptance", "0.9,0.5,0.1", "--out", str(first)]) == 0
    profile = load_profile(first)
    assert profile.acceptance_by_position == (0.9, 0.5)
    assert profile.workload["acceptance"]["source"] == "--acceptance"
    assert len(profile.workload["acceptance"]["measured"]) == 2
    for (b, k), cell in profile.cells.items():
        assert math.isclose(cell.ms_per_token, cell.step_ms / (b * expected_tokens([0.9, 0.5], k)), rel_tol=1e-3)
    for b in profile.batch_sizes:  # best k by the profile's rule (smallest k near the lowest), not a bare argmin
        assert profile.best_k[b] == best_k_of([profile.cells[b, k].ms_per_token for k in range(3)])
    assert "acceptance given by --acceptance" in capsys.readouterr().out

    second = tmp_path / "taken.json"
    assert cli.main(["profile", *common, "--acceptance-from", str(first), "--out", str(second)]) == 0
    assert load_profile(second).acceptance_by_position == (0.9, 0.5)
    assert load_profile(second).workload["acceptance"]["source"] == str(first)
    assert cli.main(["profile", *common, "--acceptance", "0.9", "--out", str(second)]) == 2


# ---- the services as processes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_processes(tmp_path_factory, tokenizer, zygote):
    root = tmp_path_factory.mktemp("random-shapes")
    target = tiny_shape(root / "target", layers=2, tokenizer=tokenizer)
    draft = tiny_shape(root / "draft", layers=1, hidden=32)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    options = StackOptions(target_model=target, draft_model=draft, random_weights=True, device="cpu", dtype="float32",
                           ports=ports, max_batch_size=4, kv_cache_gb=0.01)  # float32: compared with a float32 reference
    stack = LocalProcesses(options, zygote.start).start(timeout=180)
    yield stack, target
    stack.stop()


def test_up_with_random_weights(random_processes):
    """`specbatch up --random-weights`: the services build the same seeded weights as here, so
    greedy output through the stack equals this process's own decoding of the shape."""
    stack, target = random_processes
    prompt = [1, 7, 22, 9, 40]
    result = generate(connect(stack.address), make_request(prompt, 12, k=2, ignore_eos=True))
    assert result.token_ids == greedy_reference(random_model(target, "cpu", torch.float32), prompt, 12)


def test_profile_of_random_shapes(random_processes, tmp_path):
    stack, target = random_processes
    out = tmp_path / "profile.json"
    code = cli.main(["profile", "--random-weights", "--target-model", target, "--target", stack.target_address,
                     "--draft", stack.draft_address, "--batch-sizes", "1,2", "--max-k", "2", "--steps", "2",
                     "--warmup-steps", "1", "--max-prompt-tokens", "64", "--acceptance", "0.8,0.6", "--out", str(out)])
    assert code == 0
    profile = load_profile(out)
    assert profile.acceptance_by_position == (0.8, 0.6)
    assert profile.target["model"].endswith("[random weights]")
    assert "random" in profile.workload["weights"]


def test_bench_folds_prompts_into_a_smaller_vocabulary(tmp_path, tokenizer):
    """`specbatch bench --random-weights` with a shape whose vocabulary is smaller than its
    tokenizer's sends each prompt as chat-template ids modulo that vocabulary (the coordinator would
    refuse the others); where the tokenizer fits, the prompts go as text."""
    from specbatch.commands.bench.run import fitted_prompts

    fits = tiny_shape(tmp_path / "fits", tokenizer=tokenizer)
    options = StackOptions(random_weights=True, target_model=fits, draft_model=fits)
    assert fitted_prompts(["w1 w2"], options) == ["w1 w2"]
    small = tiny_shape(tmp_path / "small", tokenizer=tokenizer)
    config = json.loads((Path(small) / "config.json").read_text())
    config["vocab_size"] = VOCAB // 4
    (Path(small) / "config.json").write_text(json.dumps(config))
    (folded,) = fitted_prompts(["w1 w2 w90"], StackOptions(random_weights=True, target_model=fits, draft_model=small))
    expected = chat_token_ids(tokenizer, [{"role": "user", "content": "w1 w2 w90"}])
    assert folded == [t % (VOCAB // 4) for t in expected] and max(expected) >= VOCAB // 4

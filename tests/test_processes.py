"""The services as separate processes (python -m …), the way `specbatch up` runs them."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny import greedy_reference

from specbatch.commands import cli
from specbatch.config.options import WIDE_THREADS_ENV, parser_for
from specbatch.rpc.client import connect, generate, make_request
from specbatch.rpc.reflection import register_v1_descriptor
from specbatch.stack.defaults import (
    ALONE_SPINCOUNT,
    EMBEDDED_GPU_PROFILE,
    WIDE_SPINCOUNT,
    StackOptions,
    default_k_policy,
    free_port,
    threads_per_service,
)
from specbatch.stack.processes import LocalProcesses
from specbatch.v1 import generation_pb2 as gpb


@pytest.fixture(scope="module")
def processes(tmp_path_factory, target_model, tokenizer, zygote):
    folder = tmp_path_factory.mktemp("tiny-target")
    target_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    options = StackOptions(target_model=str(folder), dtype="float32", draft_model=str(folder), draft_layers=2, ports=ports,
                           max_batch_size=4)
    stack = LocalProcesses(options, zygote.start).start(timeout=180)
    yield stack
    stack.stop()


def test_greedy_through_processes(processes, target_model):
    prompt = [1, 7, 22, 9, 40]
    result = generate(connect(processes.address), make_request(prompt, 30, k=3, ignore_eos=True))
    assert result.token_ids == greedy_reference(target_model, prompt, 30)


def test_reflection_lists_services(processes):
    with grpc.insecure_channel(processes.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"specbatch.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_reflection_v1(processes):
    """A client of reflection v1 (its own message types, the v1 method path) lists the services
    and gets descriptors, the v1 reflection service's own included."""
    pool = descriptor_pool.DescriptorPool()  # the client's own, as generated v1 code would have
    register_v1_descriptor(pool)
    request_type = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    response_type = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    assert request_type is not reflection_pb2.ServerReflectionRequest
    with grpc.insecure_channel(processes.address) as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=request_type.SerializeToString,
                                     response_deserializer=response_type.FromString)
        replies = list(info(iter([request_type(list_services=""),
                                  request_type(file_containing_symbol="specbatch.v1.Generation"),
                                  request_type(file_containing_symbol="grpc.reflection.v1.ServerReflection")]),
                            timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"specbatch.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names
    files = [[descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
             for reply in replies[1:]]
    assert any(f.package == "specbatch.v1" and any(s.name == "Generation" for s in f.service) for f in files[0])
    assert [(f.name, f.package) for f in files[1]] == [("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")]


def test_generate_command_json(processes, capsys):
    code = cli.main(["generate", "--token-ids", "1,7,22", "--max-new-tokens", "5", "--json", "--k", "2",
                     "--ignore-eos", "--address", processes.address])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [t for line in lines for t in line.get("token_ids", [])]
    assert len(ids) == 5
    assert lines[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_stop_is_clean(tmp_path_factory, target_model, tokenizer):
    """Plain ``python -m`` processes, as `specbatch up` starts them (the other tests fork theirs)."""
    folder = tmp_path_factory.mktemp("tiny-stop")
    target_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    stack = LocalProcesses(StackOptions(target_model=str(folder), dtype="float32", draft_model="none", ports=ports)).start(timeout=180)
    children = [p for _, p in stack.processes]
    result = generate(connect(stack.address), make_request([1, 5, 6], 4, ignore_eos=True))
    assert len(result.token_ids) == 4
    # SIGTERM to the coordinator mid-stream: the stream still finishes (drain), then it exits 0.
    coordinator = dict(stack.processes)["coordinator"]
    stream = connect(stack.address).Generate(make_request([1, 5, 6], 200, ignore_eos=True), timeout=120)
    tokens = list(next(stream).token_ids)
    coordinator.send_signal(signal.SIGTERM)
    responses = list(stream)
    tokens += [t for r in responses for t in r.token_ids]
    assert responses[-1].finish_reason == gpb.FINISH_REASON_LENGTH
    assert tokens == greedy_reference(target_model, [1, 5, 6], 200)
    assert coordinator.wait(30) == 0
    stack.stop()
    assert [p.returncode for p in children] == [0, 0]  # SIGTERM → graceful exit, not killed


def _on_a_cpu(monkeypatch, dot=True, kernels=True, native_bf16=True, cores=None, blocks=None,
              name="a CPU no shipped profile was measured on") -> None:
    """The machine as the stack's decisions see it: the engine's kernels built (``kernels``), dot
    products as ``dot`` says (True: bf16, as on AVX512_BF16; "fp16": float16 too; False: neither),
    the GGUF block multiplies with the kernels unless ``blocks`` is False (a CPU without F16C), on
    AVX512_VNNI unless ``blocks`` is "avx2" (an AVX2-only CPU), ``cores`` cores, the model ``name``."""
    from specbatch.kernels import cpu

    monkeypatch.setattr(cpu, "model_name", lambda: name)
    monkeypatch.setattr(cpu, "multiplies_bf16", lambda: native_bf16)
    monkeypatch.setattr(cpu, "kernels_expected", lambda: kernels)
    monkeypatch.setattr(cpu, "bf16_dot_expected", lambda: kernels and bool(dot))
    monkeypatch.setattr(cpu, "blocks_expected", lambda: kernels and blocks is not False)
    monkeypatch.setattr(cpu, "blocks_on_avx2", lambda: kernels and blocks == "avx2")
    monkeypatch.setattr(cpu, "fp16_dot_expected", lambda: kernels and dot == "fp16")
    if cores is not None:
        import specbatch.stack.defaults
        import specbatch.stack.processes

        for module in (specbatch.stack.defaults, specbatch.stack.processes):
            monkeypatch.setattr(module, "available_cores", lambda: cores)


def _spawned(monkeypatch, options: dict, **machine) -> dict:
    """The processes `specbatch up` would start with ``options`` on that machine, recorded instead
    of started: module -> (its command-line flags, its environment). The draft in a process of its
    own (``--separate-draft``) unless ``options`` say otherwise, so that its flags can be read."""
    _on_a_cpu(monkeypatch, **machine)
    monkeypatch.setattr(LocalProcesses, "_wait_until_serving", lambda self, addresses, timeout: None)
    spawned = {}
    stack = LocalProcesses(StackOptions(**{"k_policy": "fixed:3", "device": "cpu", "separate_draft": True, **options}),
                           lambda module, args, env: spawned.setdefault(module, (args, env))).start()
    if stack.socket_dir:  # nothing started, so nothing stops and removes it
        os.rmdir(stack.socket_dir)
    return spawned


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (16, 8)])
def test_threads_per_service_is_half_the_cores(monkeypatch, cores, threads):
    _on_a_cpu(monkeypatch, cores=cores)
    assert threads_per_service(StackOptions()) == threads
    assert threads_per_service(StackOptions(threads=3)) == 3


@pytest.mark.parametrize("chosen, cores, service_threads, spin", [(None, 8, "4", True), (None, 2, "1", True),
                                                                  (3, 8, "3", True), (None, 1, "1", False),
                                                                  (8, 8, "8", False)])
def test_launcher_pins_each_services_threads(monkeypatch, chosen, cores, service_threads, spin):
    """`specbatch up` gives each model service its threads (flag and OMP_NUM_THREADS), the
    coordinator one; where a service has fewer threads than cores its calls go wide onto every core
    (the service decides that), with idle OpenMP threads spinning only briefly between a forward's
    parallel regions (GOMP_SPINCOUNT)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spawned = _spawned(monkeypatch, {"threads": chosen}, cores=cores)
    for module in ("target_service", "draft_service"):
        command, env = spawned[module]
        assert _flag(command, "--threads") == service_threads == env["OMP_NUM_THREADS"]
        assert (env.get("GOMP_SPINCOUNT") == str(WIDE_SPINCOUNT)) is spin
        assert (env.get(WIDE_THREADS_ENV) == str(cores)) is spin
    command, env = spawned["coordinator"]
    assert "--threads" not in command and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("options", [{"separate_draft": False}, {"draft_model": "none"}])
def test_a_target_computing_alone_spins_through_the_gaps_between_calls(monkeypatch, options):
    """With the draft hosted in the target's process (a CPU's default), or no draft, no other model
    process takes turns with the target: its idle threads spin long (ALONE_SPINCOUNT) instead of
    sleeping between calls; beside a draft process they spin briefly (above)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spawned = _spawned(monkeypatch, options, cores=2)
    assert "draft_service" not in spawned
    _, env = spawned["target_service"]
    assert env["GOMP_SPINCOUNT"] == str(ALONE_SPINCOUNT) and env[WIDE_THREADS_ENV] == "2"


def test_an_omp_wait_policy_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    _, env = _spawned(monkeypatch, {}, cores=2)["target_service"]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


@pytest.mark.parametrize("threads, wide_env, wide", [(None, None, 0), (2, "4", 4), (1, "2", 2), (4, "4", 0),
                                                    (2, None, 0)])
def test_a_service_goes_wide_where_up_says_the_cores_are_its_while_it_computes(monkeypatch, threads, wide_env, wide):
    """Within a step the draft computes, then the target: under `specbatch up` a service's calls may
    take every core; a service on its own (a pod, say) keeps to its threads."""
    import specbatch.service.main as service

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if wide_env:
        monkeypatch.setenv(WIDE_THREADS_ENV, wide_env)
    else:
        monkeypatch.delenv(WIDE_THREADS_ENV, raising=False)
    argv = ["--device", "cpu"] + (["--threads", str(threads)] if threads else [])
    settings = service.engine_settings("target", parser_for("target").parse_args(argv))
    assert settings["threads"] == threads and settings["wide_threads"] == wide


def test_services_take_a_thread_count():
    assert parser_for("target").parse_args(["--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):  # refused before any model loads
        from target_service.__main__ import main

        main(["--threads", "0", "--metrics-port", "0"])


@pytest.mark.parametrize("feature_layers, target_flags", [([2, 15], ["--feature-layers", "2,15"]), (None, [])])
def test_launcher_gives_the_target_the_feature_layers_its_draft_reads(monkeypatch, tmp_path, feature_layers,
                                                                      target_flags):
    """A draft distilled with --feature-layers (EAGLE-3 fusion) reads the outputs of those target
    layers: `specbatch up` starts the target with the same flag, read from the draft's config."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"model_type": "specbatch_eagle", "feature_layers": feature_layers}))
    spawned = _spawned(monkeypatch, {"target_model": str(tmp_path / "target"), "draft_model": str(draft)})
    target = spawned["target_service"][0]
    assert [flag for flag in target if flag == "--feature-layers"] == target_flags[:1]
    if target_flags:
        assert _flag(target, "--feature-layers") == target_flags[1]
    assert "--feature-layers" not in spawned["draft_service"][0]


@pytest.mark.parametrize("machine, options, target, draft", [
    ({"dot": "fp16"}, {}, "q4_1", "q8_0"),
    ({"dot": "fp16"}, {"weights": "fp16-dot"}, "fp16-dot", "q8_0"),
    ({"dot": True}, {}, "q4_1", "q8_0"),
    ({"dot": False}, {}, "q4_1", "q8_0"),
    ({"dot": False, "native_bf16": False}, {}, "q4_1", "q8_0"),
    ({"dot": False, "blocks": False}, {}, "bf16", "model"),
    ({"dot": True}, {"weights": "bf16-dot"}, "bf16-dot", "q8_0"),
    ({"kernels": False}, {}, "model", "model"),
    ({"kernels": False, "native_bf16": False}, {}, "model", "model"),
    ({"dot": True}, {"dtype": "float32"}, "model", "q8_0"),
    ({"dot": True}, {"dtype": "bf16"}, "model", "model"),
    ({"dot": "fp16"}, {"weights": "bf16-dot"}, "bf16-dot", "q8_0"),
    ({"dot": True}, {"weights": "q4_1"}, "q4_1", "q8_0"),
    ({"dot": True}, {"weights": "model"}, "model", "model"),
    ({"dot": True}, {"target_model": "some/target", "draft_model": "some/draft"}, "model", "model"),
    ({"dot": True}, {"target_model": "some/target", "draft_model": "some/draft", "weights": "bf16-dot"},
     "bf16-dot", "bf16-dot"),
    ({"dot": False}, {"target_model": "some/target", "draft_model": "some/draft", "weights": "q8_0"}, "q8_0", "q8_0"),
    ({"dot": True}, {"device": "cuda"}, "model", "model")])
def test_the_machine_decides_the_weight_forms(monkeypatch, machine, options, target, draft):
    """The embedded pair on a CPU where the kernels build: the target on the GGUF's own blocks
    (AVX512_VNNI, or AVX2 with F16C; AVX512_FP16 too), else on bf16 weights; the draft in Q8_0
    blocks wherever the target runs float32 arithmetic and the block kernels build; another pair
    or a GPU as loaded unless a form is named."""
    spawned = _spawned(monkeypatch, options, **machine)
    assert _flag(spawned["target_service"][0], "--weights") == target
    assert _flag(spawned["draft_service"][0], "--weights") == draft


@pytest.mark.parametrize("form, machine, kv_bf16", [
    ("bf16-dot", {}, True), ("fp16-dot", {"dot": "fp16"}, True), ("q4_1", {}, True), ("q4_1", {"dot": False}, True),
    ("bf16", {"dot": False}, False), ("model", {}, False), ("q8_0", {}, True), ("q8_0", {"dot": False}, True)])
def test_keys_and_values_are_bf16_beside_sixteen_bit_forms(monkeypatch, form, machine, kv_bf16):
    """Where the layers' inputs are rounded to 16 bits or fewer, keys and values are kept in bf16 too."""
    from specbatch.kernels import forms

    _on_a_cpu(monkeypatch, **machine)
    assert forms.kv_bf16(form) is kv_bf16


@pytest.mark.parametrize("machine, dtype, profile", [
    ({"dot": "fp16"}, None, "embedded-cpu-q4_1-in-target.json"),
    ({"dot": "fp16", "name": "Intel(R) Xeon(R) Processor"}, None, "embedded-cpu-q4_1-in-target-xeon.json"),
    ({"dot": True, "name": "AMD EPYC"}, None, "embedded-cpu-q4_1-in-target.json"),
    ({"dot": True}, None, "embedded-cpu-q4_1-in-target.json"),
    ({"dot": False}, None, "embedded-cpu-q4_1-in-target.json"),
    ({"dot": False, "blocks": "avx2", "native_bf16": False}, None, "embedded-cpu-q4_1-avx2-in-target.json"),
    ({"dot": False, "blocks": False}, None, "embedded-cpu-bf16w.json"),
    ({"dot": False, "blocks": False, "native_bf16": False}, None, "embedded-cpu-bf16w.json"),
    ({"dot": True}, "auto", "embedded-cpu-q4_1-in-target.json"),
    ({"kernels": False}, None, "embedded-cpu.json"), ({"kernels": False, "native_bf16": False}, None,
                                                       "embedded-cpu-fp32.json"),
    ({"dot": True}, "float32", "embedded-cpu-fp32.json"), ({"dot": False, "native_bf16": False}, "bf16",
                                                             "embedded-cpu.json")])
def test_embedded_default_takes_the_profile_of_the_form_the_services_run(monkeypatch, machine, dtype, profile):
    """Step times with bf16 weights, in bf16 and in fp32 differ by 1.5-2x and more, so the best k
    does too: `specbatch up` gives the coordinator the shipped profile measured in the form the
    services will run, and with the draft where it runs (in the target's process, where a profile
    was measured so; with --separate-draft, the form's profile measured with the draft apart),
    and of a form's profiles the one measured on this CPU's model, where there is one.
    A profile that names its weight forms names the ones the services run (else the coordinator
    would set it aside for `learn`)."""
    from specbatch.kernels import forms
    from specbatch.stack.defaults import weight_forms

    _on_a_cpu(monkeypatch, **machine)
    for separate, name in ((False, profile), (True, re.sub(r"-in-target(-\w+)?", "", profile))):
        options = StackOptions(dtype=dtype, device="cpu", separate_draft=separate)
        policy, path = default_k_policy(options)
        if separate and machine.get("blocks") == "avx2":  # measured hosted only: a draft apart learns
            assert (policy, path) == ("learn", None)
            continue
        assert policy == "goodput:live" and Path(path).name == name and Path(path).exists()
        shipped, served = json.loads(Path(path).read_text()), weight_forms(options)
        if "name" in machine and not separate:  # measured on this CPU's model
            assert shipped["hardware"]["name"] == machine["name"]
        if machine.get("blocks") == "avx2":  # what the coordinator holds against the services' report
            assert (shipped["hardware"]["cpu_capability"], shipped["hardware"]["native_bf16"]) == ("AVX2", False)
        assert shipped["target"].get("weights") in (None, served.target), (name, served)
        assert shipped["draft"].get("weights") in (None, served.draft), (name, served)
        assert served.draft in ("q8_0", "model") and forms.kv_bf16(served.draft) == (served.draft == "q8_0")
    assert default_k_policy(StackOptions(dtype=dtype, device="cpu", draft_model="none")) == ("learn", None)


@pytest.mark.parametrize("options, policy, gpu_profile", [
    ({}, "learn", True), ({"dtype": "bf16"}, "learn", True), ({"dtype": "float32"}, "learn", False),
    ({"target_model": "some/target"}, "learn", False), ({"draft_model": "none"}, "learn", False),
    ({"k_policy": "fixed:2"}, "fixed:2", False)])
def test_embedded_pair_on_a_gpu_in_bf16_starts_from_the_gpu_profile(monkeypatch, options, policy, gpu_profile):
    """On a GPU the embedded pair in bf16 learns from the profile measured for it there (k = 3 to
    batch 8, k = 0 from 16) and then from what it serves; the CPU's profiles would pick wrong k
    there, and other models or dtypes have no measured profile, so their coordinator learns one
    from nothing."""
    import specbatch.models.loading

    monkeypatch.setattr(specbatch.models.loading, "default_device", lambda: "cuda")
    chosen, path = default_k_policy(StackOptions(**options))
    assert chosen == policy
    assert (path is not None and Path(path) == EMBEDDED_GPU_PROFILE) is gpu_profile
    if gpu_profile:  # the file loads, and says what was measured: speculate at small batches only
        from specbatch.protocol.profile import load_profile

        profile = load_profile(path)
        assert profile.best_k_for(1) == 3 and profile.best_k_for(32) == 0


def test_embedded_services_on_a_gpu_host_get_no_cpu_forms(monkeypatch):
    """With no --device the services take the GPU where there is one; the launcher must then give
    them none of the CPU forms, which refuse CUDA: both run the model as loaded."""
    import specbatch.models.loading

    monkeypatch.setattr(specbatch.models.loading, "default_device", lambda: "cuda")
    spawned = _spawned(monkeypatch, {"device": None})
    for module in ("target_service", "draft_service"):
        assert _flag(spawned[module][0], "--weights") == "model"


@pytest.mark.parametrize("asked, gpus, target, draft", [
    (None, 2, "cuda", "cuda:1"), (None, 2, "cuda:1", "cuda:0"), (None, 1, "cuda", "cuda"),
    ("same", 2, "cuda", "cuda"), ("cuda:3", 4, "cuda", "cuda:3"), (None, 0, "cpu", "cpu")])
def test_the_draft_takes_a_gpu_of_its_own_where_the_host_has_two(monkeypatch, asked, gpus, target, draft):
    """--draft-device: by default a second GPU where the target runs on a GPU of a host with two or
    more, else beside the target; 'same' keeps it beside. Only the draft service's --device moves."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    spawned = _spawned(monkeypatch, {"device": target, "draft_device": asked, "weights": "model"})
    assert _flag(spawned["target_service"][0], "--device") == target
    assert _flag(spawned["draft_service"][0], "--device") == draft


def test_launcher_and_services_agree_on_the_cpu():
    """The launcher reads the CPU flags without torch; the services ask oneDNN and the built
    kernels. They must agree, or the coordinator would run another form's profile."""
    from specbatch.kernels import build, cpu
    from specbatch.kernels.linear import onednn_bf16_available

    assert cpu.multiplies_bf16() == onednn_bf16_available()
    assert cpu.kernels_expected() == build.available()
    assert cpu.bf16_dot_expected() == build.bf16_dot_available()
    assert cpu.fp16_dot_expected() == build.fp16_dot_available()


@pytest.mark.parametrize("policy, profile, leaves, resolved", [
    ("goodput", "p.json", None, 3), ("fixed:3", None, None, 0), ("profile", "p.json", None, 0),
    ("goodput", "p.json", 0, 0), ("fixed:2", None, 2, 2), (None, "p.json", None, 3), (None, None, None, 3),
    ("learn", None, None, 3)])
def test_goodput_gets_leaves_to_price(policy, profile, leaves, resolved):
    """Unasked, the coordinator verifies the draft's next-best tokens beside its first only under
    goodput, which takes a leaf where its row pays; other policies would verify every leaf offered.
    No policy asked: goodput over a profile, else learn, which prices leaves as goodput does."""
    from specbatch.config.speculation import SpeculationConfig

    config = SpeculationConfig(k_policy=policy, profile=profile, leaves=leaves).resolved()
    assert config.leaves == resolved
    assert config.k_policy == (policy or ("goodput" if profile else "learn"))


def test_up_passes_on_what_it_shares_with_each_program(monkeypatch):
    """Options `specbatch up` shares with a program reach it by the same flag where they differ
    from its default; what the launcher decides (ports, threads, weights) it passes itself."""
    spawned = _spawned(monkeypatch, {"kv_cache_gb": 2.0, "max_batch_size": 8, "prompt_lookup": 0, "leaves": 1,
                                     "prefill_chunk": 64, "log_level": "DEBUG", "port": 61000})
    target, draft, coordinator = (spawned[m][0] for m in ("target_service", "draft_service", "coordinator"))
    for service, port in ((target, "61001"), (draft, "61002")):
        assert _flag(service, "--kv-cache-gb") == "2.0" and _flag(service, "--port") == port
        assert _flag(service, "--log-level") == "DEBUG" and "--max-batch-size" not in service
    for flag, value in (("--max-batch-size", "8"), ("--prompt-lookup", "0"), ("--leaves", "1"),
                        ("--prefill-chunk", "64"), ("--port", "61000"), ("--target", "127.0.0.1:61001"),
                        ("--draft", "127.0.0.1:61002")):
        assert _flag(coordinator, flag) == value, (flag, coordinator)
    assert "--kv-cache-gb" not in coordinator
    parser_for("coordinator").parse_args(coordinator)  # every flag is one the coordinator takes
    for service in (target, draft):
        parser_for("target").parse_args(service)


@pytest.mark.parametrize("options, hosted", [({}, True), ({"separate_draft": True}, False),
                                             ({"draft_layers": 4}, False), ({"draft_model": "none"}, None),
                                             ({"device": "cuda", "draft_device": "cuda:1", "weights": "model"}, False),
                                             ({"device": "cuda", "draft_device": "same", "weights": "model"}, False)])
def test_the_target_hosts_the_draft_where_it_runs_on_the_targets_device(monkeypatch, options, hosted):
    """By default the target's process hosts the draft (--with-draft) and the coordinator calls
    both services at the target's address, so each Verify also drafts the next step; a draft on
    another device, one cut from the target's layers, or --separate-draft gets a process of its own."""
    spawned = _spawned(monkeypatch, {"separate_draft": False, **options})
    target, coordinator = spawned["target_service"][0], spawned["coordinator"][0]
    if hosted is None:
        assert "draft_service" not in spawned and "--with-draft" not in target
        assert _flag(coordinator, "--draft") == "none"
    elif hosted:
        assert "draft_service" not in spawned
        assert _flag(target, "--with-draft") == (options.get("draft_model") or "smollm2-135m-instruct-draft")
        assert _flag(coordinator, "--draft") == _flag(coordinator, "--target")
    else:
        assert "--with-draft" not in target and "draft_service" in spawned
        assert _flag(coordinator, "--draft") != _flag(coordinator, "--target")

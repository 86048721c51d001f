"""The services as separate processes (python -m …), the way `specbatch up` runs them."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny import greedy_reference

from specbatch.commands import cli
from specbatch.rpc.client import connect, generate, make_request
from specbatch.rpc.reflection import register_v1_descriptor
from specbatch.stack.launcher import (
    WIDE_SPINCOUNT,
    LocalProcesses,
    StackOptions,
    default_k_policy,
    free_port,
    threads_per_service,
)
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
    stack = LocalProcesses(StackOptions(target_model=str(folder), dtype="float32", no_draft=True, ports=ports)).start(timeout=180)
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


def test_threads_per_service_is_half_the_cores():
    assert [threads_per_service(cores) for cores in (1, 2, 3, 4, 8, 16)] == [1, 1, 1, 2, 4, 8]


def spawn_stack(monkeypatch, cores: int, options: StackOptions) -> dict:
    """The three processes `specbatch up` would start with ``options`` on ``cores`` cores, recorded
    instead of started: module -> (its command-line flags, its environment)."""
    import specbatch.stack.launcher as launcher

    spawned = {}
    monkeypatch.setattr(launcher, "available_cores", lambda: cores)
    stack = LocalProcesses(options, lambda module, args, env: spawned.setdefault(module, (args, env)))
    for name, module in (("target", "target_service"), ("draft", "draft_service"), ("coordinator", "coordinator")):
        stack._spawn(name, module, [])
    return spawned


@pytest.mark.parametrize("chosen, cores, service_threads", [(None, 8, "4"), (None, 2, "1"), (3, 8, "3"), (0, 8, None)])
def test_launcher_pins_each_services_threads(monkeypatch, chosen, cores, service_threads):
    """`specbatch up` gives each model service its threads (flag and OMP_NUM_THREADS), the
    coordinator one; 0 leaves torch's default and the environment alone."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    spawned = spawn_stack(monkeypatch, cores, StackOptions(threads_per_service=chosen))
    for module in ("target_service", "draft_service"):
        command, env = spawned[module]
        if service_threads is None:
            assert "--threads" not in command and env["OMP_NUM_THREADS"] == "7"
        else:
            assert command[command.index("--threads") + 1] == service_threads == env["OMP_NUM_THREADS"]
    command, env = spawned["coordinator"]
    assert "--threads" not in command and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("chosen_threads, chosen_wide, cores, wide", [
    (None, None, 2, "2"), (None, None, 8, "8"), (None, None, 1, None), (0, None, 8, None), (None, 0, 8, None),
    (1, 3, 8, "3")])
def test_launcher_gives_big_calls_the_cores(monkeypatch, chosen_threads, chosen_wide, cores, wide):
    """Within a step the draft computes, then the target: a service's calls may have every core
    (--wide-threads, from one row: --wide-from-rows 1), with idle OpenMP threads spinning only
    briefly (GOMP_SPINCOUNT) between them. Off where the services already take every core, or
    where asked."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spawned = spawn_stack(monkeypatch, cores, StackOptions(threads_per_service=chosen_threads, wide_threads=chosen_wide))
    for module in ("target_service", "draft_service"):
        command, env = spawned[module]
        if wide is None:
            assert "--wide-threads" not in command and "GOMP_SPINCOUNT" not in env
        else:
            assert command[command.index("--wide-threads") + 1] == wide
            assert command[command.index("--wide-from-rows") + 1] == "1"
            assert env["GOMP_SPINCOUNT"] == str(WIDE_SPINCOUNT) and "OMP_WAIT_POLICY" not in env
    assert "--wide-threads" not in spawned["coordinator"][0]


def test_an_omp_wait_policy_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spawned = spawn_stack(monkeypatch, 2, StackOptions(wide_from_rows=12))
    command, env = spawned["target_service"]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    assert command[command.index("--wide-from-rows") + 1] == "12"


def test_services_take_a_thread_count():
    from specbatch.service.model_service import model_service_parser

    assert model_service_parser("target", 50052, "x").parse_args(["--threads", "3"]).threads == 3
    wide = model_service_parser("target", 50052, "x").parse_args(["--wide-threads", "4", "--wide-from-rows", "16"])
    assert (wide.wide_threads, wide.wide_from_rows) == (4, 16)
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
    spawned = {}
    monkeypatch.setattr(LocalProcesses, "_wait_until_serving", lambda self, addresses, timeout: None)
    LocalProcesses(StackOptions(target_model=str(tmp_path / "target"), draft_model=str(draft), k_policy="fixed:3"),
                   lambda module, args, env: spawned.setdefault(module, args)).start()
    target = spawned["target_service"]
    assert [flag for flag in target if flag == "--feature-layers"] == target_flags[:1]
    if target_flags:
        assert target[target.index("--feature-layers") + 1] == target_flags[1]
    assert "--feature-layers" not in spawned["draft_service"]


@pytest.mark.parametrize("native_bf16, panel_kernel, bf16_dot, dtype, profile", [
    (True, True, "fp16", None, "embedded-cpu-fp16dot.json"),
    (True, True, True, None, "embedded-cpu-bf16dot.json"), (True, True, False, None, "embedded-cpu-bf16w.json"),
    (False, True, False, None, "embedded-cpu-bf16w.json"),
    (True, False, False, None, "embedded-cpu.json"), (False, False, False, None, "embedded-cpu-fp32.json"),
    (True, True, True, "float32", "embedded-cpu-fp32.json"), (False, True, False, "bf16", "embedded-cpu.json")])
def test_embedded_default_takes_the_profile_of_the_form_the_services_run(monkeypatch, native_bf16, panel_kernel,
                                                                          bf16_dot, dtype, profile):
    """Step times with bf16 weights, in bf16 and in fp32 differ by 1.5-2x and more, so the best k
    does too: `specbatch up` gives the coordinator the shipped profile measured in the form the
    services will run."""
    import specbatch.stack.launcher as launcher

    monkeypatch.setattr(launcher, "cpu_multiplies_bf16", lambda: native_bf16)
    monkeypatch.setattr(launcher, "panel_kernel_expected", lambda: panel_kernel)
    monkeypatch.setattr(launcher, "bf16_dot_expected", lambda: bool(bf16_dot))
    monkeypatch.setattr(launcher, "fp16_dot_expected", lambda: bf16_dot == "fp16")
    policy, path = launcher.default_k_policy(StackOptions(dtype=dtype))
    assert policy == "goodput" and Path(path).name == profile and Path(path).exists()
    assert launcher.default_k_policy(StackOptions(dtype=dtype, no_draft=True)) == ("fixed:3", None)


@pytest.mark.parametrize("native_bf16, options, int8", [
    (False, {}, True), (True, {}, False), (True, {"dtype": "float32"}, True), (False, {"dtype": "bf16"}, False),
    (False, {"draft_model": "some/draft"}, False), (False, {"device": "cuda"}, False),
    (False, {"draft_int8_weights": False}, False), (True, {"draft_int8_weights": True}, True),
    (True, {"bf16_weights": True}, True)])
def test_embedded_draft_runs_int8_where_the_services_run_float32_on_a_cpu(monkeypatch, native_bf16, options, int8):
    """The embedded draft's float32 forward is bound by reading its weights; the launcher gives it
    --int8-weights there (bf16 weights for the target included) unless told otherwise, and never
    elsewhere unasked."""
    import specbatch.stack.launcher as launcher

    monkeypatch.setattr(launcher, "cpu_multiplies_bf16", lambda: native_bf16)
    monkeypatch.setattr(launcher, "panel_kernel_expected", lambda: False)
    assert launcher.draft_int8_weights(StackOptions(**options)) is int8


def _spawned_on_a_cpu_with(monkeypatch, dot, options: dict) -> dict:
    """The flags the launcher gives each service (module -> args) with the engine's kernels built
    and dot products as ``dot`` says (True: bf16, "fp16": float16 too, False: neither)."""
    import specbatch.stack.launcher as launcher

    monkeypatch.setattr(launcher, "cpu_multiplies_bf16", lambda: True)
    monkeypatch.setattr(launcher, "panel_kernel_expected", lambda: True)
    monkeypatch.setattr(launcher, "bf16_dot_expected", lambda: bool(dot))
    monkeypatch.setattr(launcher, "fp16_dot_expected", lambda: dot == "fp16")
    monkeypatch.setattr(LocalProcesses, "_wait_until_serving", lambda self, addresses, timeout: None)
    spawned = {}
    LocalProcesses(StackOptions(k_policy="fixed:3", **options),
                   lambda module, args, env: spawned.setdefault(module, args)).start()
    return spawned


@pytest.mark.parametrize("dot, options, target_flags, draft_flags", [
    (False, {}, ["--dtype", "float32", "--bf16-weights"], ["--dtype", "float32", "--int8-weights"]),
    (False, {"draft_int8_weights": False}, ["--dtype", "float32", "--bf16-weights"],
     ["--dtype", "float32", "--bf16-weights"]),
    (True, {}, ["--dtype", "float32", "--bf16-dot"], ["--dtype", "float32", "--int8-weights"]),
    (True, {"draft_int8_weights": False}, ["--dtype", "float32", "--bf16-dot"], ["--dtype", "float32", "--bf16-dot"]),
    (True, {"bf16_dot": False}, ["--dtype", "float32", "--bf16-weights"], ["--dtype", "float32", "--int8-weights"]),
    (False, {"bf16_dot": True}, ["--dtype", "float32", "--bf16-dot"], ["--dtype", "float32", "--int8-weights"]),
    (True, {"dtype": "bf16"}, ["--dtype", "bf16"], ["--dtype", "bf16"]),
    (True, {"bf16_weights": False}, [], []),
    ("fp16", {}, ["--dtype", "float32", "--fp16-dot"], ["--dtype", "float32", "--int8-weights"]),
    ("fp16", {"draft_int8_weights": False}, ["--dtype", "float32", "--fp16-dot"], ["--dtype", "float32", "--fp16-dot"]),
    ("fp16", {"bf16_dot": True}, ["--dtype", "float32", "--bf16-dot"], ["--dtype", "float32", "--int8-weights"]),
    ("fp16", {"fp16_dot": False}, ["--dtype", "float32", "--bf16-dot"], ["--dtype", "float32", "--int8-weights"]),
    (True, {"fp16_dot": True}, ["--dtype", "float32", "--fp16-dot"], ["--dtype", "float32", "--int8-weights"])])
def test_embedded_services_read_bf16_weights_in_float32_where_the_panel_kernel_builds(monkeypatch, dot, options,
                                                                                     target_flags, draft_flags):
    """With the panel kernel, the embedded target and draft run float32 with bf16 weights unless a
    dtype is asked for, on float16 products where the CPU has AVX512_FP16, else on bf16 dot products
    where it has AVX512_BF16 (the draft int8 where that is on: it reads a quarter of the bytes)."""
    spawned = _spawned_on_a_cpu_with(monkeypatch, dot, options)
    for module, expected in (("target_service", target_flags), ("draft_service", draft_flags)):
        flags = [flag for flag in spawned[module] if flag in ("--dtype", "float32", "bf16", "--bf16-weights",
                                                                "--bf16-dot", "--fp16-dot", "--int8-weights")]
        assert flags == expected, (module, spawned[module])


@pytest.mark.parametrize("device, cpu_forms", [(None, False), ("cuda", False), ("cpu", True)])
def test_embedded_services_on_a_gpu_host_get_no_cpu_forms(monkeypatch, device, cpu_forms):
    """With no --device the services take the GPU where there is one; the launcher must then give
    them none of the CPU forms (int8, bf16 dot products, bf16 keys and values), which refuse CUDA,
    nor the CPU's profile: a stack with no flags on a GPU host used to die at start-up."""
    import specbatch.models.loading

    monkeypatch.setattr(specbatch.models.loading, "default_device", lambda: "cuda")
    spawned = _spawned_on_a_cpu_with(monkeypatch, True, {} if device is None else {"device": device})
    for module in ("target_service", "draft_service"):
        forms = [flag for flag in spawned[module] if flag in ("--bf16-dot", "--int8-weights", "--kv-bf16", "float32")]
        assert bool(forms) is cpu_forms, (module, spawned[module])
    policy, path = default_k_policy(StackOptions(**({} if device is None else {"device": device})))
    shipped = "embedded-cpu" if cpu_forms else "embedded-cuda-bf16.json"
    assert Path(path).name.startswith(shipped) and Path(path).exists()
    assert policy == ("goodput" if cpu_forms else "profile")


@pytest.mark.parametrize("options, policy, gpu_profile", [
    ({}, "profile", True), ({"dtype": "bf16"}, "profile", True), ({"dtype": "float32"}, "fixed:3", False),
    ({"target_model": "some/target"}, "fixed:3", False), ({"no_draft": True}, "fixed:3", False),
    ({"k_policy": "fixed:2"}, "fixed:2", False)])
def test_embedded_pair_on_a_gpu_in_bf16_serves_the_gpu_profile(monkeypatch, options, policy, gpu_profile):
    """On a GPU the embedded pair in bf16 serves the profile measured for it there (an H200, real
    weights: k = 3 to batch 8, k = 0 from 16); the CPU's profiles would pick wrong k there, and
    other models or dtypes have no measured profile, so they keep fixed:3."""
    import specbatch.models.loading
    import specbatch.stack.launcher as launcher

    monkeypatch.setattr(specbatch.models.loading, "default_device", lambda: "cuda")
    chosen, path = default_k_policy(StackOptions(**options))
    assert chosen == policy
    assert (path is not None and Path(path) == launcher.EMBEDDED_GPU_PROFILE) is gpu_profile
    if gpu_profile:  # the file loads, and says what was measured: speculate at small batches only
        from specbatch.protocol.profile import load_profile

        profile = load_profile(path)
        assert profile.best_k_for(1) == 3 and profile.best_k_for(32) == 0


@pytest.mark.parametrize("dot, options, kv_bf16", [
    (True, {}, True), ("fp16", {}, True), (False, {}, False), (True, {"kv_bf16": False}, False),
    (False, {"kv_bf16": True}, True), (True, {"dtype": "bf16"}, False), (True, {"bf16_dot": False}, False)])
def test_embedded_services_keep_bf16_keys_and_values_where_their_layers_run_on_dot_products(monkeypatch, dot, options,
                                                                                          kv_bf16):
    """Where the layers' inputs are rounded to 16 bits (bf16 or float16 dot products), both services
    keep their keys and values in bf16 too unless told otherwise; elsewhere only when asked."""
    spawned = _spawned_on_a_cpu_with(monkeypatch, dot, options)
    for module in ("target_service", "draft_service"):
        assert ("--kv-bf16" in spawned[module]) is kv_bf16, (module, spawned[module])


def test_launcher_and_services_agree_on_native_bf16():
    """The launcher reads the CPU flags without torch; the services ask oneDNN. They must agree,
    or the coordinator would run the other dtype's profile."""
    from specbatch.kernels import build
    from specbatch.kernels.linear import onednn_bf16_available
    from specbatch.stack.launcher import (
        bf16_dot_expected,
        cpu_multiplies_bf16,
        fp16_dot_expected,
        panel_kernel_expected,
    )

    assert cpu_multiplies_bf16() == onednn_bf16_available()
    assert panel_kernel_expected() == build.available()
    assert bf16_dot_expected() == build.bf16_dot_available()
    assert fp16_dot_expected() == build.fp16_dot_available()


@pytest.mark.parametrize("options, leaves", [
    ({"k_policy": "goodput", "profile": "p.json"}, "3"), ({"k_policy": "fixed:3"}, None),
    ({"k_policy": "profile", "profile": "p.json"}, None), ({"k_policy": "goodput", "profile": "p.json", "leaves": 0}, None),
    ({"k_policy": "fixed:2", "leaves": 2}, "2")])
def test_launcher_gives_goodput_leaves_to_price(monkeypatch, options, leaves):
    """Unasked, the coordinator verifies the draft's next-best tokens beside its first only under
    goodput, which takes a leaf where its row pays; other policies would verify every leaf offered."""
    monkeypatch.setattr(LocalProcesses, "_wait_until_serving", lambda self, addresses, timeout: None)
    spawned = {}
    LocalProcesses(StackOptions(**options), lambda module, args, env: spawned.setdefault(module, args)).start()
    command = spawned["coordinator"]
    assert (command[command.index("--leaves") + 1] if "--leaves" in command else None) == leaves

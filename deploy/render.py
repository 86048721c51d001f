"""Render a kustomization of deploy/k8s without kubectl: `python deploy/render.py deploy/k8s/overlays/cpu`.

CI has no kubectl, so tests/test_deploy.py renders with this where `kubectl kustomize` is not on
PATH, and checks the two agree where it is. It implements exactly the kustomize features the
manifests here use, with kustomize's semantics:

- resources: YAML files and folders holding a kustomization.yaml;
- components: folders holding a kustomization.yaml of kind Component, applied in order to what
  the resources gave (their own resources added, their namespace and patches applied to all);
- namespace: set on every object, and the name of a Namespace object (as kustomize does);
- configMapGenerator from files, only with generatorOptions.disableNameSuffixHash (a hashed
  name would need every reference rewritten);
- images: name -> newName / newTag on the containers of pod templates;
- patches: strategic merge (the patch names its target by kind and name; `$patch: delete`
  removes it) and JSON 6902 (a list of add / replace / remove ops, with target kind and name).

Anything else raises, so a kustomize feature added to the manifests is never silently ignored.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "namespace", "configMapGenerator",
                "generatorOptions", "images", "patches"}
CLUSTER_SCOPED = {"Namespace"}  # the only cluster-scoped kind the manifests hold
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

# Strategic merge keys of the lists the patches touch (from the Kubernetes API's patchMergeKey);
# every other list is replaced whole, as strategic merge does for lists without one.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}


class RenderError(ValueError):
    pass


def render(folder: str | Path) -> list[dict]:
    """The objects a kustomization folder renders to."""
    return _build(Path(folder), [], "Kustomization")


def _build(folder: Path, objects: list[dict], kind: str) -> list[dict]:
    """``objects`` with what the kustomization (or Component) in ``folder`` adds, transformed by it."""
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{folder}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text()) or {}
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{path}: unsupported kustomize fields {sorted(unknown)}")
    if k.get("kind", "Kustomization") != kind:
        raise RenderError(f"{path}: a {kind} was expected here, not a {k.get('kind', 'Kustomization')}")

    objects = list(objects)
    for entry in k.get("resources", []):
        source = folder / entry
        objects += render(source) if source.is_dir() else _load(source)
    for entry in k.get("components", []):
        objects = _build(folder / entry, objects, "Component")
    objects += _generate_configmaps(folder, k)
    for patch in k.get("patches", []):
        objects = _apply_patch(folder, patch, objects)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] in CLUSTER_SCOPED:
                if obj["kind"] == "Namespace":
                    obj["metadata"]["name"] = k["namespace"]
            else:
                obj["metadata"]["namespace"] = k["namespace"]
    for image in k.get("images", []):
        _set_image(objects, image)
    _check_unique(objects)
    return objects


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _check_unique(objects: list[dict]) -> None:
    seen = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in seen:
            raise RenderError(f"duplicate object {key}")
        seen.add(key)


def _generate_configmaps(folder: Path, k: dict) -> list[dict]:
    generators = k.get("configMapGenerator", [])
    if not generators:
        return []
    options = k.get("generatorOptions", {})
    if options != {"disableNameSuffixHash": True}:
        raise RenderError(f"{folder}: only generatorOptions.disableNameSuffixHash: true is supported")
    maps = []
    for gen in generators:
        if set(gen) - {"name", "files"}:
            raise RenderError(f"{folder}: configMapGenerator supports name and files only")
        data = {}
        for entry in gen["files"]:
            key, _, file = entry.rpartition("=")
            data[key or Path(file).name] = (folder / file).read_text()
        maps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return maps


# ---- patches ------------------------------------------------------------------------------------

def _apply_patch(folder: Path, entry: dict, objects: list[dict]) -> list[dict]:
    if set(entry) - {"patch", "path", "target"}:
        raise RenderError(f"{folder}: a patch supports patch, path and target only")
    text = entry["patch"] if "patch" in entry else (folder / entry["path"]).read_text()
    body = yaml.safe_load(text)
    if "target" in entry:
        if not isinstance(body, list):
            raise RenderError(f"{folder}: a patch with a target must be a JSON 6902 list of ops")
        target = entry["target"]
        if set(target) - {"kind", "name"}:
            raise RenderError(f"{folder}: a patch target supports kind and name only")
        matches = [o for o in objects if _matches(o, target.get("kind"), target.get("name"))]
        if not matches:
            raise RenderError(f"{folder}: patch target {target} matches nothing")
        for obj in matches:
            for op in body:
                _json6902(obj, op)
        return objects
    kind, name = body["kind"], body["metadata"]["name"]
    matches = [o for o in objects if _matches(o, kind, name)]
    if len(matches) != 1:
        raise RenderError(f"{folder}: strategic merge patch for {kind}/{name} matches {len(matches)} objects")
    if body.get("$patch") == "delete":
        return [o for o in objects if o is not matches[0]]
    merged = _merge(matches[0], body, "")
    return [merged if o is matches[0] else o for o in objects]


def _matches(obj: dict, kind: str | None, name: str | None) -> bool:
    return (kind is None or obj["kind"] == kind) and (name is None or obj["metadata"]["name"] == name)


def _merge(original, patch, field: str):
    """Strategic merge of ``patch`` into ``original`` (``field`` is the key they sit under)."""
    if isinstance(patch, dict) and isinstance(original, dict):
        directives = {key for key in patch if key.startswith("$")}
        if directives:
            raise RenderError(f"unsupported strategic merge directive {sorted(directives)} under {field!r}")
        result = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                result.pop(key, None)
            elif key in result:
                result[key] = _merge(result[key], value, key)
            else:
                result[key] = copy.deepcopy(value)
        return result
    if isinstance(patch, list) and isinstance(original, list):
        key = _merge_key(field, original + patch)
        if key is None:
            return copy.deepcopy(patch)
        by_key = {item[key]: item for item in patch}
        merged = [_merge(item, by_key[item[key]], field) if item[key] in by_key else copy.deepcopy(item)
                  for item in original]
        present = {item[key] for item in original}
        # kustomize puts the patch's new items before the original ones.
        return [copy.deepcopy(item) for item in patch if item[key] not in present] + merged
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list) -> str | None:
    if field == "ports":  # container ports merge on containerPort, Service ports on port
        return "containerPort" if all("containerPort" in item for item in items) else "port"
    return MERGE_KEYS.get(field)


def _json6902(obj: dict, op: dict) -> None:
    kind = op.get("op")
    if kind not in ("add", "replace", "remove"):
        raise RenderError(f"unsupported JSON 6902 op {kind!r}")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if isinstance(parent, list):
        if kind == "add":
            parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[int(last)] = copy.deepcopy(op["value"])
        else:
            del parent[int(last)]
    else:
        if kind == "add":
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "replace":
            if last not in parent:
                raise RenderError(f"replace of missing {op['path']}")
            parent[last] = copy.deepcopy(op["value"])
        else:
            del parent[last]


# ---- images -------------------------------------------------------------------------------------

def _set_image(objects: list[dict], image: dict) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise RenderError(f"images supports name, newName and newTag only: {image}")
    for obj in objects:
        if obj["kind"] not in WORKLOADS:
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name == image["name"]:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name


def _split_image(ref: str) -> tuple[str, str | None]:
    """'registry:5000/a/b:tag' -> ('registry:5000/a/b', 'tag'); digests are not supported."""
    if "@" in ref:
        raise RenderError(f"image digests are not supported: {ref}")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    return (ref[:colon], ref[colon + 1:]) if colon > slash else (ref, None)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Rendering ``deploy/k8s`` without a kustomize binary: a small, strict subset of ``kustomize build``.

No kustomize renderer installs into this project's environment (the PyPI binding of the Go library needs
Python >= 3.14, the pure-Python packages of that name are generators, not renderers), so the deployment tests
render the overlays with this module. It implements exactly what our kustomizations use, with kustomize's
semantics, and raises ``KustomizeError`` on anything else, so a kustomization that grows a field this module does
not understand fails the tests instead of being rendered wrong.

Supported ``kustomization.yaml`` fields (``apiVersion: kustomize.config.k8s.io/v1beta1``, ``kind: Kustomization``):

- ``resources``: YAML files (one or more documents) and directories holding a ``kustomization.yaml``, relative
  to the kustomization; no URLs, no paths outside the ``deploy/k8s`` tree handed to ``build`` as ``root``.
- ``namespace``: set on every namespaced object; a ``Namespace`` object is renamed to it; the other
  cluster-scoped kinds (``CLUSTER_SCOPED``) are left alone.
- ``labels``: a list of ``{pairs, includeSelectors, includeTemplates}``. ``pairs`` go to every object's
  ``metadata.labels``; ``includeTemplates`` (or ``includeSelectors``) also to pod templates; ``includeSelectors``
  also to selectors (``Service.spec.selector``, ``spec.selector.matchLabels`` of workloads and
  ``PodDisruptionBudget``).
- ``commonLabels``: a mapping, the same as one ``labels`` entry with ``includeSelectors: true``.
- ``images``: ``{name, newName, newTag, digest}``, matched on the image name (without tag or digest) of every
  ``containers``/``initContainers`` entry of a pod spec.
- ``patches``: a list of ``{path | patch, target}``. A patch that parses as a YAML list is a JSON6902 patch
  (RFC 6902 ``add``, ``remove``, ``replace``, ``test``; JSON pointers with ``~0``/``~1`` and ``-``) and needs a
  ``target`` (``group``, ``version``, ``kind``, ``name``, ``namespace``). A mapping is a strategic-merge patch,
  applied to the ``target`` objects (the patch's own ``metadata.name`` is then ignored) or, without a target, to
  the one object with the patch's ``apiVersion``, ``kind`` and ``metadata.name``.

Strategic merge as the API server and kustomize do it for the fields we patch: mappings merge recursively, ``null``
deletes a key, ``$patch: replace`` / ``$patch: delete`` in a mapping replace / delete it; lists of objects with a
merge key (``MERGE_KEYS``: containers by name, volumeMounts by mountPath, ...) merge item by item, the result
holding the patch's items in its order, then the base items it does not name; ``$patch: delete`` in an item
removes the match; the lists in ``ATOMIC_LISTS`` are replaced whole. A
patch that reaches any other list raises, because its strategy is not known here.

Order, as kustomize applies the transformers: resources (sub-kustomizations fully built first), then patches in
their order, then namespace, labels, images. Output keeps the input order (``kustomize build --reorder none``).
Not supported (and rejected): generators, ``replacements``, ``components``, ``namePrefix``/``nameSuffix``,
``patchesStrategicMerge``/``patchesJson6902``, ``replicas``, ``vars``, remote resources, ``$setElementOrder`` and
``$retainKeys``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_FIELDS = frozenset(
    {"apiVersion", "kind", "resources", "namespace", "labels", "commonLabels", "images", "patches"}
)
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "PersistentVolume",
        "StorageClass",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PriorityClass",
        "RuntimeClass",
        "DeviceClass",
        "APIService",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    }
)
WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})
# Lists of objects merged item by item, by field name -> merge key (``ports``: containerPort or Service port).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "claims": "name",
}
# Lists replaced whole by a strategic-merge patch (no merge strategy in the Kubernetes API).
ATOMIC_LISTS = frozenset({"args", "command", "tolerations", "envFrom", "accessModes", "add", "drop", "items"})


class KustomizeError(ValueError):
    """A kustomization or patch outside the supported subset, or one that does not apply."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: every document must be an object with apiVersion, kind and metadata")
    return docs


def build(directory: Path, root: Path | None = None) -> list[dict[str, Any]]:
    """``kustomize build DIRECTORY`` for the supported subset; ``root`` bounds the files it may read."""
    directory = directory.resolve()
    root = (root or directory).resolve()
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    with open(kfile) as f:
        spec = yaml.safe_load(f) or {}
    unknown = sorted(set(spec) - SUPPORTED_FIELDS)
    if unknown:
        raise KustomizeError(f"{kfile}: fields not supported by this renderer: {', '.join(unknown)}")
    if spec.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or spec.get("kind") != "Kustomization":
        raise KustomizeError(f"{kfile}: apiVersion/kind must be kustomize.config.k8s.io/v1beta1 Kustomization")

    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = _inside(directory / entry, root, kfile)
        objects += build(path, root) if path.is_dir() else load_documents(path)
    _check_unique(objects, kfile)
    for patch in spec.get("patches", []):
        _apply_patch(objects, patch, directory, root, kfile)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = spec["namespace"]
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    label_sets = list(spec.get("labels", []))
    if "commonLabels" in spec:
        label_sets.append({"pairs": spec["commonLabels"], "includeSelectors": True})
    for labels in label_sets:
        _apply_labels(objects, labels, kfile)
    for image in spec.get("images", []):
        _apply_image(objects, image, kfile)
    return objects


def _inside(path: Path, root: Path, kfile: Path) -> Path:
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise KustomizeError(f"{kfile}: {path} is outside {root}")
    if not resolved.exists():
        raise KustomizeError(f"{kfile}: {path} does not exist")
    return resolved


def _key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def _check_unique(objects: list[dict[str, Any]], kfile: Path) -> None:
    seen = set()
    for obj in objects:
        if _key(obj) in seen:
            raise KustomizeError(f"{kfile}: {obj['kind']}/{obj['metadata']['name']} is defined twice")
        seen.add(_key(obj))


# --- patches --------------------------------------------------------------------------------------------------


def _apply_patch(objects: list[dict[str, Any]], entry: dict[str, Any], directory: Path, root: Path, kfile: Path):
    unknown = sorted(set(entry) - {"path", "patch", "target"})
    if unknown or ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{kfile}: a patch needs exactly one of path/patch (and optionally target): {entry}")
    text = _inside(directory / entry["path"], root, kfile).read_text() if "path" in entry else entry["patch"]
    body = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(body, list):
        if not target:
            raise KustomizeError(f"{kfile}: a JSON6902 patch needs a target")
        for obj in _targets(objects, target, kfile):
            _json6902(obj, body, kfile)
    elif isinstance(body, dict):
        if target:
            matched = _targets(objects, target, kfile)
        else:
            want = (body.get("apiVersion"), body.get("kind"), (body.get("metadata") or {}).get("name"))
            matched = [o for o in objects if (o["apiVersion"], o["kind"], o["metadata"]["name"]) == want]
            if len(matched) != 1:
                raise KustomizeError(f"{kfile}: strategic-merge patch for {want} matches {len(matched)} objects")
        body = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
        if target and isinstance(body.get("metadata"), dict):  # with a target, the patch's own name is ignored
            body["metadata"] = {k: v for k, v in body["metadata"].items() if k not in ("name", "namespace")}
        for obj in matched:
            merged = strategic_merge(obj, body, "")
            obj.clear()
            obj.update(merged)
    else:
        raise KustomizeError(f"{kfile}: a patch must be a mapping (strategic merge) or a list (JSON6902)")


def _targets(objects: list[dict[str, Any]], target: dict[str, Any], kfile: Path) -> list[dict[str, Any]]:
    unknown = sorted(set(target) - {"group", "version", "kind", "name", "namespace"})
    if unknown:
        raise KustomizeError(f"{kfile}: target fields not supported: {', '.join(unknown)}")

    def hit(obj: dict[str, Any]) -> bool:
        group, _, version = obj["apiVersion"].rpartition("/")
        have = {"group": group, "version": version, "kind": obj["kind"], **obj["metadata"]}
        return all(have.get(k, "") == v for k, v in target.items())

    matched = [o for o in objects if hit(o)]
    if not matched:
        raise KustomizeError(f"{kfile}: patch target {target} matches no object")
    return matched


def strategic_merge(base: Any, patch: Any, path: str) -> Any:
    """``patch`` merged into ``base`` as a strategic-merge patch (see the module docstring); returns a copy."""
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        body = {k: v for k, v in patch.items() if k != "$patch"}
        if directive == "replace":
            return copy.deepcopy(body)
        if directive is not None:
            raise KustomizeError(f"{path or '/'}: $patch: {directive} is not supported here")
        for key in body:
            if key.startswith("$"):
                raise KustomizeError(f"{path}/{key}: directive not supported")
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in body.items():
            if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
                out.pop(key, None)
            elif key in out:
                out[key] = _merge_field(key, out[key], value, f"{path}/{key}")
            else:
                out[key] = strategic_merge(None, value, f"{path}/{key}") if isinstance(value, dict) else value
        return out
    return copy.deepcopy(patch)


def _merge_field(key: str, base: Any, value: Any, path: str) -> Any:
    if not isinstance(value, list):
        return strategic_merge(base, value, path)
    if key in ATOMIC_LISTS:
        return copy.deepcopy(value)
    merge_key = MERGE_KEYS.get(key)
    if key == "ports":
        merge_key = "containerPort" if all("containerPort" in p for p in [*base, *value]) else "port"
    if merge_key is None or not isinstance(base, list):
        raise KustomizeError(f"{path}: the strategic-merge strategy of this list is not known to this renderer")
    originals = {old.get(merge_key): old for old in base if isinstance(old, dict)}
    merged, mentioned = [], set()
    for item in value:
        if not isinstance(item, dict) or merge_key not in item:
            raise KustomizeError(f"{path}: every item needs its merge key {merge_key!r}")
        mentioned.add(item[merge_key])
        if item.get("$patch") != "delete":
            merged.append(strategic_merge(originals.get(item[merge_key]), item, f"{path}[{item[merge_key]}]"))
    return merged + [copy.deepcopy(old) for old in base if old.get(merge_key) not in mentioned]


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise KustomizeError(f"JSON6902: {path} does not exist")
    return doc


def _json6902(obj: dict[str, Any], ops: list[dict[str, Any]], kfile: Path) -> None:
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        if kind not in ("add", "remove", "replace", "test"):
            raise KustomizeError(f"{kfile}: JSON6902 op {kind!r} not supported (add, remove, replace, test)")
        parts = _pointer(path)
        parent, last = _walk(obj, parts[:-1], path), parts[-1]
        if kind == "test":
            if _walk(parent, [last], path) != op["value"]:
                raise KustomizeError(f"{kfile}: JSON6902 test failed at {path}")
        elif isinstance(parent, list):
            if kind == "add":
                index = len(parent) if last == "-" else int(last)
                if not 0 <= index <= len(parent):
                    raise KustomizeError(f"JSON6902: {path} is out of range")
                parent.insert(index, copy.deepcopy(op["value"]))
            else:
                _walk(parent, [last], path)
                if kind == "remove":
                    del parent[int(last)]
                else:
                    parent[int(last)] = copy.deepcopy(op["value"])
        elif isinstance(parent, dict):
            if kind != "add":
                _walk(parent, [last], path)
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = copy.deepcopy(op["value"])
        else:
            raise KustomizeError(f"JSON6902: the parent of {path} is not an object or a list")


# --- transformers ---------------------------------------------------------------------------------------------


def pod_specs(obj: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """The pod specs of an object (a workload's template, a Pod, a CronJob's job template)."""
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        yield spec
    elif obj["kind"] in WORKLOADS:
        yield spec["template"]["spec"]
    elif obj["kind"] == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]


def _apply_labels(objects: list[dict[str, Any]], labels: dict[str, Any], kfile: Path) -> None:
    unknown = sorted(set(labels) - {"pairs", "includeSelectors", "includeTemplates"})
    if unknown:
        raise KustomizeError(f"{kfile}: labels fields not supported: {', '.join(unknown)}")
    pairs = {str(k): str(v) for k, v in labels["pairs"].items()}
    selectors = bool(labels.get("includeSelectors"))
    templates = selectors or bool(labels.get("includeTemplates"))
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        spec = obj.get("spec", {})
        if templates and obj["kind"] in WORKLOADS:
            spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if not selectors:
            continue
        if obj["kind"] == "Service":
            spec.setdefault("selector", {}).update(pairs)
        elif obj["kind"] in WORKLOADS or obj["kind"] == "PodDisruptionBudget":
            spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)


def split_image(image: str) -> tuple[str, str, str]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a registry port is part of the name."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest


def _apply_image(objects: list[dict[str, Any]], image: dict[str, Any], kfile: Path) -> None:
    unknown = sorted(set(image) - {"name", "newName", "newTag", "digest"})
    if unknown or "name" not in image:
        raise KustomizeError(f"{kfile}: images entries take name, newName, newTag, digest: {image}")
    for obj in objects:
        for pod in pod_specs(obj):
            for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                name, tag, digest = split_image(container["image"])
                if name != image["name"]:
                    continue
                name = image.get("newName", name)
                if "digest" in image:
                    container["image"] = f"{name}@{image['digest']}"
                elif "newTag" in image:
                    container["image"] = f"{name}:{image['newTag']}"
                else:
                    container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")

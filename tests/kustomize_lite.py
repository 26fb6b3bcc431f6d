"""A small kustomize renderer for the features deploy/k8s uses, for machines without ``kubectl``.

Supported in a kustomization: ``resources`` (YAML files and kustomization folders), ``namespace``,
``patches`` (``path:`` to a strategic-merge patch, matched by kind and name) and ``images`` (``name``,
``newName``, ``newTag``, ``digest``). Anything else is an error, so a manifest that starts using another
kustomize feature fails here loudly instead of rendering differently from ``kubectl kustomize``. The tests
compare this renderer with ``kubectl kustomize`` wherever kubectl is installed.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "RuntimeClass", "IngressClass", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
}
# Strategic merge: lists of objects merged by this key (the Kubernetes patchMergeKey), others replaced.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
}
POD_SPEC_PATHS = (("spec", "template", "spec"), ("spec", "jobTemplate", "spec", "template", "spec"),
                  ("spec",))

Object = dict[str, Any]


class KustomizeError(ValueError):
    pass


def _kustomization_file(folder: Path) -> Path:
    for name in KUSTOMIZATION_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise KustomizeError(f"{folder}: no kustomization.yaml")


def _load_documents(path: Path) -> list[Object]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "metadata" not in doc:
            raise KustomizeError(f"{path}: not a Kubernetes object: {doc!r:.80}")
    return docs


def _key(obj: Object) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """A strategic-merge patch of plain maps and lists (no ``$patch`` directives)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    merge_key = MERGE_KEYS.get(field)
    if isinstance(base, list) and isinstance(patch, list) and merge_key:
        out = list(base)
        for item in patch:
            index = next((i for i, old in enumerate(out) if old.get(merge_key) == item.get(merge_key)), None)
            if index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item)
        return out
    return copy.deepcopy(patch)


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``name[:tag][@digest]`` -> (name, tag, digest); a registry port is not taken for a tag."""
    name, _, digest = image.partition("@")
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


def _set_images(obj: Object, images: list[dict[str, str]]) -> None:
    for spec_path in POD_SPEC_PATHS:
        spec: Any = obj
        for part in spec_path:
            spec = spec.get(part) if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or "containers" not in spec:
            continue
        for kind in ("initContainers", "containers", "ephemeralContainers"):
            for container in spec.get(kind) or []:
                name, tag, digest = split_image(container["image"])
                for rule in images:
                    if rule["name"] != name:
                        continue
                    new = rule.get("newName", name)
                    if "newTag" in rule:
                        tag = rule["newTag"]
                    if "digest" in rule:
                        digest = rule["digest"]
                    container["image"] = new + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        return


def render(folder: str | Path) -> list[Object]:
    """The objects ``kubectl kustomize folder`` would print (order aside)."""
    folder = Path(folder)
    kfile = _kustomization_file(folder)
    k = yaml.safe_load(kfile.read_text()) or {}
    unsupported = set(k) - SUPPORTED_KEYS
    if unsupported:
        raise KustomizeError(f"{kfile}: kustomize_lite does not support {sorted(unsupported)}")
    objects: list[Object] = []
    for entry in k.get("resources") or []:
        path = folder / entry
        if re.match(r"^[a-z]+://", entry) or not path.exists():
            raise KustomizeError(f"{kfile}: resource {entry!r} is not a local file or folder")
        objects.extend(render(path) if path.is_dir() else _load_documents(path))
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        if _key(obj) in seen:
            raise KustomizeError(f"{kfile}: {_key(obj)} is defined twice")
        seen.add(_key(obj))
    for entry in k.get("patches") or []:
        if set(entry) != {"path"}:
            raise KustomizeError(f"{kfile}: only 'path:' patches are supported, got {entry}")
        for patch in _load_documents(folder / entry["path"]):
            index = next((i for i, o in enumerate(objects) if _key(o) == _key(patch)), None)
            if index is None:
                raise KustomizeError(f"{kfile}: patch {entry['path']} matches no resource {_key(patch)}")
            objects[index] = strategic_merge(objects[index], patch)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    if k.get("images"):
        for obj in objects:
            _set_images(obj, k["images"])
    return objects

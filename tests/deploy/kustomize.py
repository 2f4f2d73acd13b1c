"""A small renderer of the kustomize features deploy/kubernetes uses, so no kubectl is needed.

Supported, and nothing else (anything else in a kustomization raises ``Unsupported``, so a new
feature cannot be silently ignored): ``resources`` (files and folders with a kustomization),
``components`` (``kind: Component``), ``configMapGenerator`` (``files``, ``literals``) and
``secretGenerator`` (``envs``, ``literals``) with kustomize's content-hash name suffix, and the
rewriting of the generated names where a pod template refers to them. When kubectl is installed,
tests/deploy compares this renderer's output with ``kubectl kustomize``.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_KEYS = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "secretGenerator"}
BASE64_LINE = 70
Object = dict[str, Any]


class Unsupported(Exception):
    """The kustomization uses a feature this renderer does not implement."""


def render(folder: Path) -> list[Object]:
    """Every object ``kustomize build folder`` would output (not sorted)."""
    objects, renames = _build(folder.resolve(), expect_kind="Kustomization")
    for obj in objects:
        _rename_references(obj, renames)
    return objects


def name_hash(obj: Object) -> str:
    """kustomize's suffix: sha256 of the object's compact JSON, 10 hex digits, some letters swapped.

    kustomize (v5) looks the name up as one field called "metadata/name", finds nothing and hashes
    an empty name; the same is done here, since the point is to produce the names it produces.
    """
    if obj["kind"] == "ConfigMap":
        encoded: Object = {"kind": "ConfigMap", "name": "", "data": obj.get("data", {})}
    else:
        encoded = {
            "kind": "Secret",
            "type": obj.get("type", "Opaque"),
            "name": "",
            "data": obj.get("data", {}),
        }
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # Go's encoding/json escapes these three for HTML safety; kustomize hashes Go's bytes.
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _kustomization(folder: Path) -> Object:
    for name in KUSTOMIZATION_FILES:
        if (folder / name).is_file():
            loaded: Object = yaml.safe_load((folder / name).read_text())
            return loaded
    raise FileNotFoundError(f"no kustomization in {folder}")


def _build(folder: Path, expect_kind: str) -> tuple[list[Object], dict[tuple[str, str], str]]:
    spec = _kustomization(folder)
    if spec.get("kind", "Kustomization") != expect_kind:
        raise Unsupported(f"{folder}: kind {spec.get('kind')!r}, expected {expect_kind}")
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise Unsupported(f"{folder}: {sorted(unknown)}")
    objects: list[Object] = []
    renames: dict[tuple[str, str], str] = {}
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            found, found_renames = _build(path, "Kustomization")
            objects += found
            renames.update(found_renames)
        else:
            objects += [obj for obj in yaml.safe_load_all(path.read_text()) if obj]
    for entry in spec.get("configMapGenerator", []):
        objects.append(_config_map(folder, entry, renames))
    for entry in spec.get("secretGenerator", []):
        objects.append(_secret(folder, entry, renames))
    for entry in spec.get("components", []):
        found, found_renames = _build((folder / entry).resolve(), "Component")
        objects += found
        renames.update(found_renames)
    return objects, renames


def _check_generator(entry: Object, allowed: set[str]) -> None:
    unknown = set(entry) - allowed - {"name"}
    if unknown:
        raise Unsupported(f"generator {entry.get('name')}: {sorted(unknown)}")


def _config_map(folder: Path, entry: Object, renames: dict[tuple[str, str], str]) -> Object:
    _check_generator(entry, {"files", "literals"})
    data: dict[str, str] = {}
    for file in entry.get("files", []):
        key, _, path = file.rpartition("=") if "=" in file else (Path(file).name, "", file)
        data[key] = (folder / path).read_text()
    for literal in entry.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    obj: Object = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": entry["name"]}, "data": data}
    return _suffixed(obj, renames)


def _secret(folder: Path, entry: Object, renames: dict[tuple[str, str], str]) -> Object:
    _check_generator(entry, {"envs", "literals"})
    pairs: list[tuple[str, str]] = []
    for env_file in entry.get("envs", []):
        pairs += list(_env_lines((folder / env_file).read_text()))
    for literal in entry.get("literals", []):
        key, _, value = literal.partition("=")
        pairs.append((key, value))
    data = {key: _base64(value) for key, value in pairs}
    obj: Object = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": entry["name"]},
        "type": "Opaque",
        "data": data,
    }
    return _suffixed(obj, renames)


def _base64(value: str) -> str:
    """kustomize's encoding: plain base64 up to 70 characters, else 70-character lines, each ended."""
    encoded = base64.b64encode(value.encode()).decode()
    if len(encoded) <= BASE64_LINE:
        return encoded
    return "".join(encoded[i : i + BASE64_LINE] + "\n" for i in range(0, len(encoded), BASE64_LINE))


def _env_lines(text: str) -> Iterator[tuple[str, str]]:
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            yield key, value


def _suffixed(obj: Object, renames: dict[tuple[str, str], str]) -> Object:
    name = obj["metadata"]["name"]
    suffixed = f"{name}-{name_hash(obj)}"
    renames[(obj["kind"], name)] = suffixed
    result = copy.deepcopy(obj)
    result["metadata"]["name"] = suffixed
    return result


def _pod_specs(obj: Object) -> Iterator[Object]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        yield spec
    elif "template" in spec:
        yield spec["template"].get("spec", {})
    elif "jobTemplate" in spec:
        yield spec["jobTemplate"]["spec"]["template"].get("spec", {})


def _rename_references(obj: Object, renames: dict[tuple[str, str], str]) -> None:
    def renamed(kind: str, name: str) -> str:
        return renames.get((kind, name), name)

    for pod in _pod_specs(obj):
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                volume["configMap"]["name"] = renamed("ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                volume["secret"]["secretName"] = renamed("Secret", volume["secret"]["secretName"])
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    source["configMapRef"]["name"] = renamed("ConfigMap", source["configMapRef"]["name"])
                if "secretRef" in source:
                    source["secretRef"]["name"] = renamed("Secret", source["secretRef"]["name"])
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    ref["configMapKeyRef"]["name"] = renamed("ConfigMap", ref["configMapKeyRef"]["name"])
                if "secretKeyRef" in ref:
                    ref["secretKeyRef"]["name"] = renamed("Secret", ref["secretKeyRef"]["name"])

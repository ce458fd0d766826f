"""Rendering and schema checks shared by the deploy tests: ``kubectl kustomize`` for the
manifests under deploy/kubernetes, ``kubernetes-validate`` for built-in kinds and the
vendored CRDs (deploy/kubernetes/crds/) for the custom resources."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
CRDS = KUSTOMIZE / "crds"
#: Every kustomization a user may apply: the base and each overlay.
TARGETS = ("base", "overlays/single-gpu", "overlays/inference-pool", "overlays/keda")
#: The Kubernetes releases the built-in kinds are checked against: the kubectl these
#: machines carry (v1.32) and the newest release kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.32", "latest")
#: libyaml's loader where PyYAML has it: the HTTPRoute CRD alone is 0.4 MB.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
#: (API group, kind) of each custom resource the overlays render -> its vendored CRD.
CRD_FILES = {
    (
        "inference.networking.k8s.io",
        "InferencePool",
    ): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render_dir(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize PATH``, parsed. Raises ``AssertionError`` with kubectl's
    message when it refuses."""
    exe = kubectl()
    assert exe is not None, "kubectl is not on PATH"
    out = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.load_all(out.stdout, Loader=_LOADER) if d]


@functools.cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    """One target of :data:`TARGETS`, rendered once per test run (copies: tests mutate)."""
    return tuple(render_dir(KUSTOMIZE / target))


def objects(target: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(render(target)))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def group_of(doc: dict[str, Any]) -> str:
    api = doc["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def is_custom(doc: dict[str, Any]) -> bool:
    return (group_of(doc), doc["kind"]) in CRD_FILES


@functools.cache
def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    """The served version's ``openAPIV3Schema`` of a vendored CRD, made strict: an
    object schema with properties refuses other keys (the API server would prune or,
    with strict field validation, refuse them) unless it preserves unknown fields."""
    path = CRDS / CRD_FILES[(group, kind)]
    crd = yaml.load(path.read_text(), Loader=_LOADER)
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, path
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            assert v["served"], f"{path}: {kind} {version} is not served"
            return _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    served = [v["name"] for v in crd["spec"]["versions"]]
    raise AssertionError(f"{path}: {kind} has no version {version}; it serves {served}")


def _strict(schema: Any) -> Any:  # noqa: ANN401 - any JSON value
    if isinstance(schema, dict):
        for value in schema.values():
            _strict(value)
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def validate_custom(doc: dict[str, Any]) -> None:
    """Raises ``jsonschema.ValidationError`` where ``doc`` breaks its CRD's schema."""
    import jsonschema

    version = doc["apiVersion"].split("/")[1]
    schema = crd_schema(group_of(doc), doc["kind"], version)
    # A CRD's schema is OpenAPI 3.0's subset of JSON Schema, which follows draft 4
    # (exclusiveMinimum as a boolean, for one).
    jsonschema.Draft4Validator(schema).validate(doc)


def validate_builtin(doc: dict[str, Any], version: str) -> None:
    """Raises ``kubernetes_validate.ValidationError`` where ``doc`` breaks the
    Kubernetes API schema of ``version`` (strict: unknown fields are errors)."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(
        doc, latest_version() if version == "latest" else version, strict=True
    )


def serve_config(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The serve config the Deployment mounts: (its text, parsed)."""
    deployment = one(docs, "Deployment", "kvcached-serve")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    cm_name = volumes["config"]["configMap"]["name"]
    text = one(docs, "ConfigMap", cm_name)["data"]["serve.yaml"]
    return text, yaml.safe_load(text)

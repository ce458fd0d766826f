"""deploy/kubernetes renders with the real ``kubectl kustomize`` (base and every overlay),
and every object it renders validates: built-in kinds against the Kubernetes API
schema (kubernetes-validate, strict), custom resources against the CRDs of their
own releases (deploy/kubernetes/crds/, strict)."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.deploy_manifests import (
    CRD_FILES,
    KUBERNETES_VERSIONS,
    TARGETS,
    group_of,
    is_custom,
    kubectl,
    objects,
    one,
    validate_builtin,
    validate_custom,
)

pytestmark = pytest.mark.skipif(
    kubectl() is None,
    reason="kubectl is not on PATH, so the manifests cannot be rendered here "
    "(kubectl >= 1.27 carries kustomize v5; CI's machine has v1.32)",
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason='pip install -e ".[test]" (kubernetes-validate)'
)
jsonschema = pytest.importorskip("jsonschema", reason='pip install -e ".[test]" (jsonschema)')


@pytest.mark.parametrize("target", TARGETS)
def test_renders_named_objects(target: str) -> None:
    docs = objects(target)
    assert docs, f"{target} rendered nothing"
    seen = set()
    for d in docs:
        key = (d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
        assert key not in seen, f"{target} renders {key} twice"
        seen.add(key)
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "kvcached", f"{key} has no namespace"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_builtin_objects_validate_against_the_kubernetes_api(target: str, version: str) -> None:
    builtin = [d for d in objects(target) if not is_custom(d)]
    assert builtin
    for d in builtin:
        try:
            validate_builtin(d, version)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{target}: {d['kind']} {d['metadata']['name']} breaks Kubernetes {version}'s "
                f"schema at {'.'.join(map(str, exc.path))}: {exc.message}"
            )


@pytest.mark.parametrize("target", TARGETS)
def test_custom_resources_validate_against_their_crds(target: str) -> None:
    for d in objects(target):
        if not is_custom(d):
            continue
        try:
            validate_custom(d)
        except jsonschema.ValidationError as exc:
            pytest.fail(
                f"{target}: {d['kind']} {d['metadata']['name']} breaks "
                f"{CRD_FILES[(group_of(d), d['kind'])]} at "
                f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}"
            )


def test_every_vendored_crd_is_used() -> None:
    kinds = {(group_of(d), d["kind"]) for t in TARGETS for d in objects(t) if is_custom(d)}
    assert kinds == set(CRD_FILES)


def test_the_checks_refuse_what_an_api_server_would() -> None:
    """The schemas bite: a misspelt field, a wrong type, a missing required field."""
    docs = objects("overlays/inference-pool")
    pool = copy.deepcopy(one(docs, "InferencePool", "kvcached-llama-8b"))
    pool["spec"]["selektor"] = pool["spec"].pop("selector")
    with pytest.raises(jsonschema.ValidationError, match="selektor|selector"):
        validate_custom(pool)
    pool = copy.deepcopy(one(docs, "InferencePool", "kvcached-llama-8b"))
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError, match="70000"):
        validate_custom(pool)

    scaled = copy.deepcopy(one(objects("overlays/keda"), "ScaledObject"))
    del scaled["spec"]["triggers"][0]["type"]
    with pytest.raises(jsonschema.ValidationError, match="type"):
        validate_custom(scaled)

    deployment = copy.deepcopy(one(docs, "Deployment", "kvcached-serve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(deployment, "1.32")
    deployment = copy.deepcopy(one(docs, "Deployment", "kvcached-serve"))
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_builtin(deployment, "latest")

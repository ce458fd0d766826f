"""What the rendered manifests promise docs/kubernetes.md, checked on kubectl's output:
the base's pod (config, GPU, the one memory volume, probes, scraping, weights,
failure policy, image), the inference-pool overlay's pools and pickers against serve's
config and metrics, the keda overlay's triggers, and that a config change rolls."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_manifests import (
    KUSTOMIZE,
    ROOT,
    find,
    kubectl,
    objects,
    one,
    render_dir,
    serve_config,
)

pytestmark = pytest.mark.skipif(
    kubectl() is None,
    reason="kubectl is not on PATH, so the manifests cannot be rendered here "
    "(kubectl >= 1.27 carries kustomize v5; CI's machine has v1.32)",
)

SERVE_TARGETS = ("base", "overlays/single-gpu", "overlays/inference-pool", "overlays/keda")


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", "kvcached-serve")["spec"]["template"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return c


@pytest.mark.parametrize("target", SERVE_TARGETS)
def test_serve_runs_the_generated_config_on_one_gpu(target: str) -> None:
    docs = objects(target)
    pod = _pod(docs)
    serve = _container(pod, "serve")
    _, config = serve_config(docs)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in serve["volumeMounts"]}
    # The ConfigMap's name carries kustomize's content hash (the pod template refers to it).
    assert re.fullmatch(
        r"kvcached-serve-config-[a-z0-9]{10}", volumes["config"]["configMap"]["name"]
    )
    assert serve["command"][-1] == mounts["config"]["mountPath"] + "/serve.yaml"
    assert serve["command"][:-1] == ["python3", "-m", "kvcached", "serve"]
    assert serve["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = {p["name"]: p["containerPort"] for p in serve["ports"]}["http"]
    assert (config["host"], config["port"]) == ("0.0.0.0", port)


@pytest.mark.parametrize("target", SERVE_TARGETS)
def test_one_memory_volume_holds_the_ledger_and_the_engines_shared_memory(target: str) -> None:
    docs = objects(target)
    pod = _pod(docs)
    serve = _container(pod, "serve")
    _, config = serve_config(docs)
    memory = [v for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(memory) == 1, "one memory volume, sized in one place"
    assert re.fullmatch(r"\d+[GM]i", memory[0]["emptyDir"]["sizeLimit"])
    (shm,) = [m for m in serve["volumeMounts"] if m["name"] == memory[0]["name"]]
    assert shm["mountPath"] == "/dev/shm"
    env = {e["name"]: e.get("value") for e in serve["env"]}
    assert env["KVCACHED_LEDGER_DIR"] == "/dev/shm"  # every engine inherits it from serve
    assert config["state_dir"].startswith("/dev/shm/")
    for c in pod["spec"]["containers"]:  # no second /dev/shm anywhere in the pod
        for m in c.get("volumeMounts", []):
            assert m["mountPath"] != "/dev/shm" or m["name"] == memory[0]["name"]


@pytest.mark.parametrize("target", SERVE_TARGETS)
def test_probes_scraping_weights_and_failure_policy(target: str) -> None:
    docs = objects(target)
    pod = _pod(docs)
    serve = _container(pod, "serve")
    _, config = serve_config(docs)
    # Ready once every eager model serves (/ready); then as long as the router answers
    # (/health): a lazy model's cold start must not take the pod's other models out.
    assert serve["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = serve["startupProbe"]["periodSeconds"] * serve["startupProbe"]["failureThreshold"]
    eager = [m for m in config["models"] if m.get("start", "eager") == "eager"]
    assert startup >= max(m.get("startup_timeout", 600) for m in eager)
    assert serve["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert serve["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(config["port"])
    assert notes["prometheus.io/path"] == "/metrics"
    assert config["public_metrics"] is True  # scrapers send no API key
    # Weights from a read-only volume, nothing from a hub.
    models = next(m for m in serve["volumeMounts"] if m["name"] == "models")
    assert models["readOnly"] is True
    for m in config["models"]:
        assert m["model"].startswith(models["mountPath"] + "/"), m["name"]
    env = {e["name"]: e.get("value") for e in serve["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    # A model failed for good either stops serve (the kubelet restarts the container)
    # or leaves it failed while the others serve; both need a container that restarts.
    assert config["on_model_failure"] in ("exit", "keep-serving")
    assert pod["spec"]["restartPolicy"] == "Always"
    # After the preStop pause, serve stops engines one after another, each up to its
    # stop_timeout; the grace period covers all of it.
    (sleep, pause) = serve["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    stops = sum(m.get("stop_timeout", 60) for m in config["models"])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(pause) + stops + 30


def test_weights_come_from_a_claim_in_the_base_and_the_node_in_single_gpu() -> None:
    base = objects("base")
    claim = _pod(base)["spec"]["volumes"]
    assert {"claimName": "kvcached-models", "readOnly": True} in [
        v.get("persistentVolumeClaim") for v in claim
    ]
    one(base, "PersistentVolumeClaim", "kvcached-models")
    single = objects("overlays/single-gpu")
    assert not find(single, "PersistentVolumeClaim")
    (models,) = [v for v in _pod(single)["spec"]["volumes"] if v["name"] == "models"]
    assert set(models) == {"name", "hostPath"}


def test_a_config_change_renames_the_configmap_and_so_rolls_the_pods(tmp_path: Path) -> None:
    copy = tmp_path / "base"
    shutil.copytree(KUSTOMIZE / "base", copy)
    before = render_dir(copy)
    serve_yaml = copy / "serve.yaml"
    serve_yaml.write_text(serve_yaml.read_text().replace("idle_after: 120", "idle_after: 60"))
    after = render_dir(copy)
    old = _pod(before)["spec"]["volumes"]
    new = _pod(after)["spec"]["volumes"]
    assert old != new  # the pod template changed: the Deployment rolls out
    name = next(v["configMap"]["name"] for v in new if v["name"] == "config")
    assert "idle_after: 60" in one(after, "ConfigMap", name)["data"]["serve.yaml"]


def test_the_image_is_named_once_and_built_on_a_supported_vllm() -> None:
    kustomization = yaml.safe_load((KUSTOMIZE / "base" / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    expected = f"{image['newName']}:{image['newTag']}"
    for target in SERVE_TARGETS:
        for c in _pod(objects(target))["spec"]["containers"]:
            assert c["image"] == expected, (target, c["name"])
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    vllm = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+\.\d+\.\d+)$", dockerfile, re.M)
    assert vllm, "deploy/Dockerfile names no vllm/vllm-openai:vX.Y.Z"
    assert image["newTag"].endswith(f"vllm-v{vllm[1]}")
    # ... a release the README's supported-versions table says yes to.
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"^\| vLLM \([^)]*\) \| {re.escape(vllm[1])} \| yes \|", readme, re.M)
    assert f"-t {expected} ." in dockerfile  # its build command makes that tag


def _epp_config(docs: list[dict[str, Any]], deployment: dict[str, Any]) -> dict[str, Any]:
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    (name,) = [v["configMap"]["name"] for v in volumes if "configMap" in v]
    (text,) = one(docs, "ConfigMap", name)["data"].values()
    return yaml.safe_load(text)


#: The parameters of the picker's plugins this overlay sets, as v1.5.0's source names them
#: (gateway-api-inference-extension, pkg/epp/framework/plugins/datalayer/extractor/metrics/
#: factories.go and source/metrics/datasource.go): the picker ignores a key it does not know.
EXTRACTOR_KEYS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_KEYS = {
    "name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
    "cacheInfoSpec", "cacheBlockSizeLabelName", "cacheNumBlocksLabelName",
    "cacheBlockSizeSpec", "cacheNumBlocksSpec",
}  # fmt: skip
DATA_SOURCE_KEYS = {"scheme", "path", "insecureSkipVerify"}


def _check_plugin_keys(config: dict[str, Any]) -> None:
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in declared, ref
    for p in config["plugins"]:
        params = p.get("parameters", {})
        if p["type"] == "core-metrics-extractor":
            assert set(params) <= EXTRACTOR_KEYS, params
            for engine in params["engineConfigs"]:
                assert set(engine) <= ENGINE_KEYS, engine
        elif p["type"] == "metrics-data-source":
            assert set(params) <= DATA_SOURCE_KEYS, params


def test_each_model_has_an_inference_pool_that_reads_its_own_series() -> None:
    """For every model of serve's config: a pool over serve's pods that carry the
    model's routable label, on serve's port; a picker watching that pool whose three
    gauges are that model's series in serve's /metrics; a route to the pool."""
    from kvcached.serve.metrics import _GATEWAY

    served_series = {name for name, *_ in _GATEWAY}
    docs = objects("overlays/inference-pool")
    _, config = serve_config(docs)
    pod_labels = _pod(docs)["metadata"]["labels"]
    route = one(docs, "HTTPRoute", "kvcached")
    pools = {p["metadata"]["name"]: p for p in find(docs, "InferencePool")}
    assert len(pools) == len(config["models"])
    for m in config["models"]:
        name = m["name"]
        (pool,) = [
            p
            for p in pools.values()
            if f"model.kvcached.io/{name}" in p["spec"]["selector"]["matchLabels"]
        ]
        selector = pool["spec"]["selector"]["matchLabels"]
        assert selector.pop(f"model.kvcached.io/{name}") == "routable"
        assert selector.items() <= pod_labels.items()  # the rest picks serve's pods
        assert pool["spec"]["targetPorts"] == [{"number": config["port"]}]
        service = one(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
        port = pool["spec"]["endpointPickerRef"]["port"]["number"]
        assert port in [p["port"] for p in service["spec"]["ports"]]
        epps = [
            d
            for d in find(docs, "Deployment")
            if service["spec"]["selector"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(epps) == 1, f"the picker Service of {name} selects {len(epps)} Deployments"
        args = epps[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
        epp_config = _epp_config(docs, epps[0])
        plugins = {p["type"]: p for p in epp_config["plugins"]}
        _check_plugin_keys(epp_config)
        assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
        extractor = plugins["core-metrics-extractor"]["parameters"]
        (engine,) = [
            e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]
        ]
        for key, series in (
            ("queuedRequestsSpec", "vllm:num_requests_waiting"),
            ("runningRequestsSpec", "vllm:num_requests_running"),
            ("kvUsageSpec", "vllm:kv_cache_usage_perc"),
        ):
            assert engine[key] == f'{series}{{model_name="{name}"}}'
            assert series in served_series
        rules = [
            r
            for r in route["spec"]["rules"]
            if {"type": "Exact", "name": "X-Gateway-Model-Name", "value": name}
            in [h for mt in r["matches"] for h in mt.get("headers", [])]
        ]
        assert [b["name"] for r in rules for b in r["backendRefs"]] == [pool["metadata"]["name"]]


def test_the_podlabels_sidecar_may_patch_its_pod() -> None:
    docs = objects("overlays/inference-pool")
    pod = _pod(docs)
    sidecar = _container(pod, "podlabels")
    assert sidecar["command"][:3] == ["python3", "-m", "kvcached.serve.podlabels"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    account = pod["spec"]["serviceAccountName"]
    bindings = [
        b
        for b in find(docs, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account, "namespace": "kvcached"} in b["subjects"]
    ]
    (binding,) = bindings
    role = one(docs, "Role", binding["roleRef"]["name"])
    assert any("pods" in r["resources"] and "patch" in r["verbs"] for r in role["rules"])


def test_keda_scales_on_each_models_waiting_gauge_scraped_by_the_service_monitor() -> None:
    docs = objects("overlays/keda")
    _, config = serve_config(docs)
    scaled = one(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "kvcached-serve"
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}
    for m in config["models"]:
        assert f'model_name="{m["name"]}"' in queries[f"{m['name']}-waiting"]
        assert "vllm:num_requests_waiting{" in queries[f"{m['name']}-waiting"]
    assert len(queries) == len(config["models"])
    monitor = one(docs, "ServiceMonitor", "kvcached-serve")
    service = one(docs, "Service", "kvcached-serve")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"

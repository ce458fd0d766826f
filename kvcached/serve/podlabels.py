"""Each model's routability as a label on serve's own Kubernetes pod (a sidecar).

A gateway's ``InferencePool`` selects pods by label, and its endpoint picker
takes only pods that are Ready and match. One pod runs every model of its GPU,
so the pod's readiness cannot take one failed model out of its pool while the
others serve (``on_model_failure: keep-serving``). This loop reads serve's
``/ready`` (no API key needed) and keeps one label per model on the pod:

    model.kvcached.io/<model>: routable   any state but failed: a request to a
                                          sleeping, stopped or starting model
                                          waits while serve wakes or starts it
    model.kvcached.io/<model>: failed     its requests get 503 until serve
                                          restarts it (or for good)

and each model's pool selects ``model.kvcached.io/<model>: routable``
(``deploy/kubernetes/overlays/inference-pool``). A pod gets no model label
until this loop has read serve once, so a pod whose labeller does not run
takes no gateway traffic, rather than traffic nobody checks.

It patches only its own pod (``POD_NAME``, ``POD_NAMESPACE`` from the
downward API) with the pod's service-account token, re-read for every patch
(the kubelet rotates it), and patches only when a label changes.
Run it as ``python -m kvcached.serve.podlabels``; it needs the standard
library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from kvcached.log import get_logger

log = get_logger("kvcached.serve")

LABEL_PREFIX = "model.kvcached.io/"
ROUTABLE, FAILED = "routable", "failed"
#: A label key's name part (after the prefix), as Kubernetes validates it.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def label_key(model: str) -> str:
    """The label that carries ``model``'s routability. Raises ``ValueError`` for a
    model name Kubernetes refuses as a label name (one ending in ``.``, ``_``, ``-``)."""
    if len(model) > 63 or not _LABEL_NAME.match(model):
        raise ValueError(
            f"model name {model!r} cannot be a Kubernetes label name ({LABEL_PREFIX}<model>): "
            "at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter "
            "or digit; rename the model in serve's config"
        )
    return LABEL_PREFIX + model


def desired_labels(ready: Mapping[str, object]) -> dict[str, str]:
    """The labels for one ``/ready`` answer (``{"models": {name: state}, ...}``)."""
    models = ready.get("models")
    if not isinstance(models, dict):
        raise ValueError(f"serve's /ready answer has no 'models' object: {ready!r}")
    return {
        label_key(name): FAILED if state == "failed" else ROUTABLE for name, state in models.items()
    }


def read_ready(url: str, timeout_s: float = 2.0) -> dict[str, object] | None:
    """serve's ``/ready`` document (it answers 503 with the same JSON while a model
    starts or failed); ``None`` while serve does not answer."""
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                log.warning("podlabels: %s answered %d", url, exc.code)
                return None
            doc = json.loads(exc.read())
    except (OSError, ValueError) as exc:  # not up yet, or not JSON
        log.debug("podlabels: %s not read: %s", url, exc)
        return None
    if not isinstance(doc, dict):
        log.warning("podlabels: %s answered no JSON object: %.200r", url, doc)
        return None
    return doc


class PodPatcher:
    """Merge-patches the labels of one pod through the Kubernetes API."""

    def __init__(
        self,
        namespace: str,
        pod: str,
        api_server: str = "",
        token_path: str = SERVICE_ACCOUNT + "/token",
        ca_path: str = SERVICE_ACCOUNT + "/ca.crt",
    ) -> None:
        if not api_server:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError(
                    "KUBERNETES_SERVICE_HOST is not set: not inside a pod; pass --api-server"
                )
            api_server = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        self.url = f"{api_server.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}"
        self.token_path = token_path
        self._ssl = None
        if self.url.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=ca_path)

    def patch_labels(self, labels: Mapping[str, str]) -> None:
        """Raises ``OSError`` (``urllib.error.HTTPError`` with the API's answer) on failure."""
        with open(self.token_path) as f:
            token = f.read().strip()
        body = json.dumps({"metadata": {"labels": dict(labels)}}).encode()
        req = urllib.request.Request(
            self.url,
            data=body,
            method="PATCH",
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/merge-patch+json",
                "Accept": "application/json",
            },
        )
        with urllib.request.urlopen(req, timeout=10, context=self._ssl) as resp:
            resp.read()


def run(
    ready_url: str, patcher: PodPatcher, interval_s: float = 1.0, iterations: int | None = None
) -> None:
    """Read ``/ready`` every ``interval_s`` and patch the pod when a label changes
    (forever, or ``iterations`` times). A failed patch is retried at the next read."""
    published: dict[str, str] | None = None
    n = 0
    while iterations is None or n < iterations:
        n += 1
        doc = read_ready(ready_url)
        if doc is not None:
            labels = desired_labels(doc)
            if labels != published:
                try:
                    patcher.patch_labels(labels)
                except urllib.error.HTTPError as exc:
                    log.error(
                        "podlabels: PATCH %s answered %d: %s (does the pod's service account "
                        "have 'patch' on pods? deploy/kubernetes/base/rbac.yaml)",
                        patcher.url,
                        exc.code,
                        exc.read()[:300].decode(errors="replace"),
                    )
                except OSError as exc:
                    log.error("podlabels: PATCH %s failed: %s", patcher.url, exc)
                else:
                    log.info("podlabels: %s", ", ".join(f"{k}={v}" for k, v in labels.items()))
                    published = labels
        if iterations is None or n < iterations:
            time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcached.serve.podlabels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--serve-url",
        default="http://127.0.0.1:8000",
        help="serve's router, as seen from this container (default: %(default)s)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    parser.add_argument(
        "--api-server",
        default="",
        help="the Kubernetes API (default: the in-cluster https://$KUBERNETES_SERVICE_HOST)",
    )
    args = parser.parse_args(argv)
    missing = [v for v in ("POD_NAME", "POD_NAMESPACE") if not os.environ.get(v)]
    if missing:
        print(
            f"podlabels: {' and '.join(missing)} not set; give them from the downward API "
            "(fieldRef metadata.name, metadata.namespace)",
            file=sys.stderr,
        )
        return 2
    if not args.interval > 0:
        print(f"podlabels: --interval={args.interval}: must be > 0", file=sys.stderr)
        return 2
    try:
        patcher = PodPatcher(
            os.environ["POD_NAMESPACE"], os.environ["POD_NAME"], api_server=args.api_server
        )
    except (ValueError, OSError) as exc:
        print(f"podlabels: {exc}", file=sys.stderr)
        return 2
    try:
        run(args.serve_url.rstrip("/") + "/ready", patcher, args.interval)
    except ValueError as exc:  # a model name that cannot be a label: say it, stop
        print(f"podlabels: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

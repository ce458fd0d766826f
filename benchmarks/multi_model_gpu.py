"""The multi-model benchmark's GPU servers: vLLM (0.26 on the H200) serving one
8B-shaped model under three names, kvcached sharing the GPU against a static split.

**Memory** (H200, 143,771 MiB; Llama-3.1-8B's shape: 14.96 GiB of bf16 weights,
128 KiB of KV per token): three engines hold 44.9 GiB of weights and, eager,
about 2 GiB each of context, activations and buffers, so ~51 GiB; the ledger
keeps ``total x (1 - KVCACHED_GPU_UTILIZATION)`` (7.0 GiB at 0.95) back, so the
three share a KV budget of ~82 GiB, ~27 GiB (~220k tokens) for each of the
static thirds. ``kvcached``: the three start together with kvcached on and one
ledger; each may grow into the whole budget. ``native``: the same three with
``--kv-cache-memory-bytes`` = a third of the KV budget that the ``kvcached``
configuration's ledger had (``budget_bytes`` once its servers were up; the
run's ``setup.kv_total_bytes``), so both have the same KV memory in all. A
fixed size makes vLLM skip its profile-based sizing, so the three start
together too and each gets exactly its share (sized by
``--gpu-memory-utilization`` they would have to start one after another, each
counting the others' memory); ``--gpu-memory-utilization 0.05`` only keeps
vLLM's start check (free memory >= that share of the device) from refusing
the second and third.

**Why the GPU trace is not upstream's** (:data:`GPU_TRACE`): upstream's
requests (256 prompt + 256 output tokens) hold at most 64 MiB each; at 20
req/s and ~7 s end to end (256 tokens at ~40 tok/s per stream) a model has
~140 in flight, ~9 GiB: a third of an A100-80G (~6.8 GB of KV) runs out, a
third of an H200 (~27 GiB) never does, so upstream's sweep on an H200 would
measure ~1x by construction. Here prompts are 2,048-3,072 tokens and outputs
512 (a request holds 320-448 MiB at its end; ~352 MiB on average over its
life, prompt plus half its output): a static third holds ~78 of them. At a
peak of P req/s per model and ~18 s end to end (prefill of ~2.5k tokens plus
512 eager decode steps at ~30 tok/s per stream under load) a model has ~18 x P
in flight (Little's law), so a static third fills at P ~ 4.4 (0.92 of it at 4,
1.15 at 5, 1.38 at 6; sooner where queueing stretches the end to end) while
compute does not: prefill is ~2.5k x P tokens/s for the model
at its peak (under 20k tok/s for P <= 6, which an H200 prefills for an 8B at
bf16), and upstream's stagger (``MODEL_DELAY = PEAK/4 + 2*PEAK``) keeps one
model at its peak at a time while the others run at 1 req/s. :func:`kv_plan`
writes this arithmetic per peak into the result (``plan.steady_state``).

That steady state is not what the trace does: with no hold a model passes its
peak in a moment, and what it holds in flight is the busiest end-to-end window
of its arrivals, ``(P - 1)^2 + W`` for W ~ 15 s, mostly the low rate's. The
peaks are therefore sized by ``gpu_plan.multi_model_plan`` from the card (H100:
the knee at ~2.1 req/s, measured between 2.0 and 2.5; H200: ~8), and the
result's ``plan`` is that arithmetic.
"""

from __future__ import annotations

import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvharness.gpu_models import MODELS as GPU_MODELS
from kvharness.gpu_models import make_model
from kvharness.gpu_server import Server, log_findings
from multi_model_client import Target, kvctl_ledger

GIB = 1 << 30
SHAPE = "llama-3.1-8b"
#: The GPU sweep's trace (``multi_model.py --device gpu``'s defaults): upstream's
#: ramp (0 -> peak -> 1 req/s at 1 req/s per second, no hold, its stagger) with
#: longer requests, so that KV memory binds before compute (the docstring).
#: The peaks are not here: ``gpu_plan.multi_model_plan`` sizes them to the card.
GPU_TRACE: dict[str, Any] = {
    "low": 1.0,
    "slope": 1.0,
    "hold_s": 0.0,
    "tail_s": 10.0,
    "prompt_min": 2048,
    "prompt_max": 3072,
    "max_tokens": 512,
    "upstream_delay": True,
}


@dataclass(frozen=True)
class GpuSetup:
    """One configuration's servers on the GPU (both configurations use the same)."""

    model_dir: Path
    models: tuple[str, ...] = ("mm-a", "mm-b", "mm-c")
    base_port: int = 8600
    #: KVCACHED_GPU_UTILIZATION: the ledger keeps total x (1 - this) back
    utilization: float = 0.95
    max_model_len: int = 4096
    max_num_seqs: int = 256
    device_args: tuple[str, ...] = ("--enforce-eager",)
    #: More KVCACHED_* settings for the kvcached servers (``--kvcached-env``).
    kvcached_env: tuple[tuple[str, str], ...] = ()


def prepare_model(models_dir: Path, make_model_py: str) -> Path:
    """The 8B-shaped model folder (made once by the bundle's ``make_model.py``)."""
    return make_model(SHAPE, models_dir / SHAPE, make_model_py)


def server_args(setup: GpuSetup, config: str, kv_share_bytes: int | None) -> list[str]:
    """One server's vLLM arguments. ``native`` needs ``kv_share_bytes``."""
    args = [
        "--max-model-len",
        str(min(setup.max_model_len, GPU_MODELS[SHAPE]["max_model_len"])),
        "--max-num-seqs",
        str(setup.max_num_seqs),
        # Every prompt is unique: a prefix cache would only hold idle blocks.
        "--no-enable-prefix-caching",
        "--enable-per-request-metrics",
        *setup.device_args,
    ]
    if config == "native":
        if not kv_share_bytes:
            raise ValueError("native servers need kv_share_bytes (a third of the KV budget)")
        args += [
            "--kv-cache-memory-bytes",
            str(kv_share_bytes),
            "--gpu-memory-utilization",
            "0.05",
        ]
    elif config != "kvcached":
        raise ValueError(f"config={config!r} is not valid: kvcached or native")
    return args


def server_env(setup: GpuSetup, config: str, name: str, ledger_dir: Path) -> dict[str, str]:
    if config == "native":
        return {"ENABLE_KVCACHED": "false"}
    return {
        "ENABLE_KVCACHED": "true",
        "KVCACHED_IPC_NAME": name,
        "KVCACHED_LEDGER_DIR": str(ledger_dir),
        "KVCACHED_GPU_UTILIZATION": str(setup.utilization),
        "KVCACHED_LOG_LEVEL": "info",
        **dict(setup.kvcached_env),
    }


class GpuServers:
    """One configuration's servers, started together; :meth:`close` stops them."""

    def __init__(
        self,
        setup: GpuSetup,
        config: str,
        workdir: Path,
        tag: str,
        kv_share_bytes: int | None = None,
    ) -> None:
        self.setup, self.config = setup, config
        self.ledger_dir = workdir / "ledger"
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        args = server_args(setup, config, kv_share_bytes)
        self.servers = [
            Server(
                name,
                setup.base_port + i,
                str(setup.model_dir),
                args,
                server_env(setup, config, name, self.ledger_dir),
                workdir / f"{tag}-{name}.log",
            )
            for i, name in enumerate(setup.models)
        ]
        self.ready_s: dict[str, float | None] = {}

    def start(self, timeout_s: float = 420.0) -> list[Target]:
        """Start every server, wait until all answer ``/health``; their targets.
        Raises RuntimeError (with every server stopped) if one does not come up."""
        for s in self.servers:
            s.start()
        self.ready_s = {s.name: s.wait_ready(timeout_s) for s in self.servers}
        failed = [n for n, t in self.ready_s.items() if t is None]
        if failed:
            self.close()
            tails = {s.name: log_tail(s.log) for s in self.servers if s.name in failed}
            raise RuntimeError(f"{self.config}: {failed} did not start; their logs end: {tails}")
        return [
            Target(s.name, s.name, s.port, s.port, s.proc.pid if s.proc else 0)
            for s in self.servers
        ]

    def kv_budget_bytes(self, settle_s: float = 3.0) -> int:
        """The ledger's budget once the servers are up (``kvcached`` only): what
        the three may hold together, after a calibration or two has seen the
        weights of all three."""
        time.sleep(settle_s)
        row = kvctl_ledger(self.ledger_dir, [s.name for s in self.servers])
        if not row:
            raise RuntimeError(f"no ledger under {self.ledger_dir} holds {self.setup.models}")
        return int(row["budget_bytes"])

    def findings(self) -> dict[str, Any]:
        """Per server what its log shows (kvcached active, bad lines)."""
        return {s.name: log_findings(s.log, self.config == "kvcached") for s in self.servers}

    def close(self) -> dict[str, float | None]:
        return {s.name: s.stop() for s in self.servers}


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` of a log (what a failed start says), or why there is none."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return repr(exc)


def pack_logs(workdir: Path, dest: Path) -> Path:
    """Every server log of the work folder in one ``dest`` tarball: a device call
    returns at most 8 files, and the logs live in a temporary folder."""
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(workdir.glob("*.log")):
            tar.add(path, arcname=path.name)
    return dest


def kv_plan(
    peak: float,
    prompt_mean: float,
    max_tokens: int,
    kv_bytes_per_token: int,
    share_bytes: int,
    e2e_s: float,
) -> dict[str, float]:
    """What a model at ``peak`` req/s holds in flight if each request takes
    ``e2e_s`` (Little's law), its KV at ``prompt_mean + max_tokens / 2`` tokens
    each, against a static share: ``over_share`` > 1 means the static split
    queues there."""
    in_flight = peak * e2e_s
    held = in_flight * (prompt_mean + max_tokens / 2) * kv_bytes_per_token
    return {
        "peak": peak,
        "assumed_e2e_s": e2e_s,
        "in_flight": round(in_flight, 1),
        "kv_held_gib": round(held / GIB, 2),
        "share_gib": round(share_bytes / GIB, 2),
        "over_share": round(held / share_bytes, 2) if share_bytes else float("nan"),
    }


def gpu_device() -> dict[str, Any]:
    """The GPU's name and memory (``gpu_plan.read_card``: one nvidia-smi query for
    the plan and this record), or why not."""
    import gpu_plan

    card = gpu_plan.read_card()
    if card is None:
        return {"error": "nvidia-smi reported no GPU (missing, failed or timed out)"}
    return {
        "name": card.name,
        "memory_mib": card.memory_mib,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }

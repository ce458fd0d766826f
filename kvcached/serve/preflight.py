"""What ``kvcached serve`` checks before anything starts (``--check`` prints it).

Each problem is one line naming the model and key, and what would be right:

* another serve already runs with this state directory (port) or config
  file: that one line alone, first, naming the serve (its pid and router
  port), since every other problem found would be that serve's own engines;
* the router's port, or a model's fixed ``port``, is in use (an engine that a
  previous router of this state directory left running is not a problem:
  serve adopts it);
* the engine's program cannot be run: for a ``python -m MODULE`` launch
  (vLLM, SGLang, or such a ``command``), that Python cannot find the module's
  package; otherwise the program is not found or not executable;
* a local model path (absolute, ``./``, ``../`` or ``~``) does not exist;
* a live kvcached instance of a model's name runs that this serve did not
  start (the two would share one ledger record, limit included); where
  another serve started it, that serve is named.

Model names and aliases are unique already (:func:`~kvcached.serve.config.parse_config`).
Nothing here creates a file or starts a process but the import probe.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from typing import Any

from kvcached.serve.config import ModelConfig, ServeConfig, _runtime_dir
from kvcached.serve.engine import marked_groups, marker_of
from kvcached.serve.state import LOCK_FILE, StateStore, lock_holder, same_process

_PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (as the router binds: reusing TIME_WAIT)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _local_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _program_problem(where: str, argv: list[str], env: dict[str, str]) -> str | None:
    program = argv[0]
    found = program if os.sep in program else shutil.which(program, path=env.get("PATH"))
    if not found or not os.path.isfile(found):
        if os.sep in program:
            return f"{where}: the program {program} does not exist"
        return f"{where}: the program {program!r} is not on PATH={env.get('PATH', '')}"
    if not os.access(found, os.X_OK):
        return f"{where}: the program {found} is not executable"
    if len(argv) > 2 and argv[1] == "-m":
        package = argv[2].split(".")[0]
        try:
            probe = subprocess.run(
                [found, "-c", _PROBE, package],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{where}: {found} could not be asked whether it has {package}: {exc}"
        if probe.returncode == 3:
            return (
                f"{where}: {found} cannot import {package} (needed for -m {argv[2]}); install "
                f"it into that Python, or set command: to a launch command that has it"
            )
        if probe.returncode != 0:
            err = probe.stderr.decode(errors="replace").strip().splitlines()
            return f"{where}: {found} failed to start: {err[-1] if err else probe.returncode}"
    return None


def _model_problems(
    i: int, m: ModelConfig, config: ServeConfig, ours: set[int], env: dict[str, str]
) -> list[str]:
    where = f"models[{i}] ({m.name})"
    out = []
    argv = m.argv(config.engine_host, m.port or 0)
    problem = _program_problem(where, argv, m.environment(env))
    if problem:
        out.append(problem)
    if m.model and not m.command and _local_path(m.model):
        path = os.path.expanduser(m.model)
        if not os.path.exists(path):
            out.append(
                f"models[{i}].model ({m.name}): {m.model} does not exist; give an existing model directory "
                "or a model id of the hub"
            )
    if m.port is not None and not port_free(config.engine_host, m.port):
        record = StateStore.read_from(config.resolved_state_dir(), m.name)
        adoptable = (
            record is not None
            and record.port == m.port
            and same_process(record.pid, record.start_ticks)
            and record.pid in ours
        )
        if not adoptable:
            out.append(
                f"models[{i}].port ({m.name}): {config.engine_host}:{m.port} is in use by another program; "
                "choose a free port, or leave port out (a free one is picked)"
            )
    return out


def config_path(config: ServeConfig) -> str:
    """The config's file, resolved ("" for a config that is not a file's)."""
    return os.path.realpath(config.source) if os.path.isfile(config.source) else ""


def _serve_named(holder: dict[str, Any], config: bool = True) -> str:
    """Another serve, as its lock file describes it: pid, router port (, config)."""
    who = f"pid {holder.get('pid', '?')}, router port {holder.get('port', '?')}"
    return f"{who}, config {holder['config']}" if config and holder.get("config") else who


def running_serve(config: ServeConfig) -> str | None:
    """Why this serve must not start because another one runs, naming it (pid,
    router port): one holds this state directory (by default: this port), or
    runs this config file on another port (their engines would share kvcached
    instance names, limits included). None: no other serve stands in the way."""
    directory = config.resolved_state_dir()
    ours = config_path(config)
    holder = lock_holder(directory)
    if holder is not None and not (ours and holder.get("config") == ours):
        return (
            f"another kvcached serve ({_serve_named(holder)}) already runs with state "
            f"directory {directory}; stop it first, or give this one another port or state_dir"
        )
    if holder is None and ours:
        holder = _serve_of_config(ours)
    if holder is None:
        return None
    return (
        f"another kvcached serve ({_serve_named(holder, config=False)}) already runs with "
        f"config {ours}; stop it first: one serve per config file (the same models twice "
        "would share their kvcached instances)"
    )


def _serve_of_config(path: str) -> dict[str, Any] | None:
    """The lock file of a live serve of config ``path`` in the default place of
    state directories (one per port), or None."""
    for lock in sorted(glob.glob(os.path.join(_runtime_dir(), "kvcached-serve-*", LOCK_FILE))):
        holder = lock_holder(os.path.dirname(lock))
        if holder and holder.get("config") == path:
            return holder
    return None


def _foreign_instances(config: ServeConfig, ours: dict[str, set[int]]) -> list[str]:
    try:
        from kvcached.control.snapshot import read_snapshots

        snaps = read_snapshots(cleanup=False)
    except Exception:  # kvctl's view is a courtesy here, not a requirement
        return []
    out = []
    for i, m in enumerate(config.models):
        for snap in snaps:
            if not snap.alive or snap.instance != m.name or snap.data.get("serve"):
                continue
            if _group_of(snap.pid) in ours[m.name]:
                continue
            out.append(
                f"models[{i}].name ({m.name}): a kvcached instance named {m.name!r} already "
                f"runs (pid {snap.pid}), {_started_by(snap.pid)}"
            )
            break
    return out


def _started_by(pid: int) -> str:
    """Who started the foreign instance of process ``pid``, and what to do."""
    mark = marker_of(pid)
    if not mark:
        return "not started by this serve; stop it or rename the model"
    directory, model = os.path.split(mark)
    holder = lock_holder(directory)
    if holder is not None:
        return (
            f"model {model} of another kvcached serve ({_serve_named(holder)}); stop that "
            "serve, or rename the model"
        )
    return (
        f"an engine that the kvcached serve of state directory {directory} started and left "
        "running (its router is gone: a serve of that state directory adopts or stops it); "
        "stop it, or rename the model"
    )


def _group_of(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def preflight(config: ServeConfig, env: dict[str, str] | None = None) -> list[str]:
    """Every problem found, one line each; empty when serve may start."""
    env = dict(os.environ if env is None else env)
    directory = config.resolved_state_dir()
    refusal = running_serve(config)
    if refusal is not None:
        # Alone: what else would be found here (its ports, its engines' instances) is that serve.
        return [refusal]
    problems = []
    if config.port and not port_free(config.host, config.port):
        problems.append(
            f"port: {config.host}:{config.port} is in use by another program; choose "
            f"another port (port: in {config.source}, or --port)"
        )
    ours = {
        m.name: set(marked_groups(f"{os.path.abspath(directory)}/{m.name}")) for m in config.models
    }
    for i, m in enumerate(config.models):
        problems += _model_problems(i, m, config, ours[m.name], env)
    problems += _foreign_instances(config, ours)
    return problems

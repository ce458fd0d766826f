"""``kvcached serve``'s configuration: one YAML file, validated before anything starts.

Every error names the file, the line and the key path (``models[1].sleep.level``)
and says what would be right; an unknown key is an error, never ignored (a typo
in ``idle_after`` must not silently keep a model awake). Lines come from
PyYAML's node marks: the loader below records, for every mapping, the line of
each of its keys.

The result is plain frozen dataclasses (:class:`ServeConfig`,
:class:`ModelConfig`), so a script can also build one directly and hand it to
:func:`kvcached.serve.run`.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvcached.serve.engines import ENGINE_KINDS, EngineKind, engine_kind

ENGINES = tuple(ENGINE_KINDS)
SLEEP_LEVELS = ("none", "kv", "weights", "stop")
START_MODES = ("eager", "lazy")
RESTART_POLICIES = ("never", "on-failure", "always")
PRESSURE_POLICIES = ("off", "sleep-lru")
ON_MODEL_FAILURE = ("exit", "keep-serving")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ServeConfigError(ValueError):
    """The serve configuration cannot be used; the message names file, line and key."""


@dataclass(frozen=True)
class SleepConfig:
    """When and how deeply an idle model sleeps."""

    level: str = "none"  #: none | kv | weights | stop
    idle_after: float = 300.0  #: seconds with nothing in flight, from the last request's end
    stop_after: float = 600.0  #: ``stop`` level: seconds asleep before the process is stopped
    weights_level: int = 1  #: vLLM's ``/sleep?level=`` (1: weights to CPU, 2: discarded)
    #: requests the engine serves without the router (seen in its metrics) keep it awake
    engine_activity: bool = True


@dataclass(frozen=True)
class RestartConfig:
    """What happens when an engine process dies on its own."""

    policy: str = "on-failure"  #: never | on-failure | always
    max_restarts: int = 5  #: within ``window_s``; past it the model is ``failed``
    window_s: float = 600.0
    backoff_s: float = 1.0  #: first delay; doubled each time up to ``backoff_max_s``
    backoff_max_s: float = 60.0


@dataclass(frozen=True)
class ModelConfig:
    """One served model: the engine process that serves it and its policies."""

    name: str
    engine: str = "vllm"
    model: str = ""  #: the engine's model path or id (vllm, sglang)
    args: tuple[str, ...] = ()  #: more engine arguments
    #: argv that serves HTTP on ``{port}`` (``{host}``, ``{port}`` filled in): required for
    #: engine ``command``; for vllm/sglang, a launch command of your own instead of ``model``
    command: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    port: int | None = None  #: None: a free port is assigned at start
    env: Mapping[str, str] = field(default_factory=dict)
    start: str = "eager"  #: eager | lazy (on the first request)
    sleep: SleepConfig = field(default_factory=SleepConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    wake_timeout: float = 120.0  #: a request waits this long for its model to wake
    startup_timeout: float = 600.0  #: an engine not ready after this is ``failed``
    stop_timeout: float = 60.0  #: SIGINT to the engine's group, then SIGKILL after this
    #: GET answering 200 once the engine serves (from the config: its engine row's health_path)
    ready_path: str = "/health"
    kvcached: bool = True  #: set ENABLE_KVCACHED=true and KVCACHED_IPC_NAME=<name>

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def kind(self) -> EngineKind:
        return engine_kind(self.engine)

    def argv(self, host: str, port: int | str, python: str = sys.executable) -> list[str]:
        """The engine's command line on ``host:port`` (``port`` may be a placeholder
        text, for the plan)."""
        if self.command:  # the user's own launch command (any engine kind)
            return [
                part.replace("{port}", str(port)).replace("{host}", host) for part in self.command
            ]
        kind = self.kind
        argv = kind.launch(python, self.model, self.name, host, str(port))
        if self.sleep.level == "weights" and kind.weights_flag not in self.args:
            argv.append(kind.weights_flag)
        return argv + list(self.args)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The engine's environment: ``base``, this model's ``env``, then what serve sets."""
        env = dict(base)
        env.update(self.env)
        if self.kvcached:
            env["ENABLE_KVCACHED"] = "true"
            env["KVCACHED_IPC_NAME"] = self.name
        if self.sleep.level == "weights":
            env.update(self.kind.weights_env)
        return env


@dataclass(frozen=True)
class ServeConfig:
    """The whole serve: where the router listens, and the models behind it."""

    models: tuple[ModelConfig, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine_host: str = "127.0.0.1"  #: where engines listen (the router reaches them there)
    state_dir: str = ""  #: per-model state files, engine logs ("": the default below)
    pressure: str = "off"  #: off | sleep-lru
    idle_check_s: float = 0.25  #: how often the sleep policy looks
    #: a model that failed past its restart policy: ``exit`` stops serve (status 1,
    #: naming it); ``keep-serving`` keeps the others up and answers 503 for it
    on_model_failure: str = "exit"
    #: ``/metrics`` without the API key (``/health`` and ``/ready`` never need it)
    public_metrics: bool = False
    source: str = "<config>"  #: the file it came from, for messages

    def model(self, name: str) -> ModelConfig | None:
        for m in self.models:
            if name in m.served_names:
                return m
        return None

    def resolved_state_dir(self) -> str:
        if self.state_dir:
            return self.state_dir
        # Keyed by the router's port: a router restarted on that port finds its engines.
        tag = str(self.port) if self.port else f"pid{os.getpid()}"
        return os.path.join(_runtime_dir(), f"kvcached-serve-{tag}")


def _runtime_dir() -> str:
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        return run
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


# -- YAML with lines ---------------------------------------------------------------------------
class _Lines(dict):  # type: ignore[type-arg]
    """A mapping from the YAML file that knows the line of each of its keys."""

    line: int = 0
    key_lines: dict[str, int]


def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: ANN401
            out = _Lines(super().construct_mapping(node, deep=True))
            out.line = node.start_mark.line + 1
            out.key_lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value}
            return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, Loader.construct_mapping)
    return Loader


class _Reader:
    """Takes the keys of one YAML mapping, checking each; :meth:`done` refuses the rest."""

    def __init__(self, source: str, path: str, data: Any, line: int) -> None:
        self.source, self.path = source, path
        self.line = getattr(data, "line", line)
        if not isinstance(data, dict):
            self.fail(f"must be a mapping of keys, got {_kind(data)}", self.line, path)
        self.data = data
        self.key_lines: dict[str, int] = getattr(data, "key_lines", {})
        self.taken: set[str] = set()

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)

    def fail(self, message: str, line: int, path: str) -> None:
        raise ServeConfigError(f"{self.source}:{line}: {path or '(top level)'}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def get(
        self,
        key: str,
        kind: str,
        default: Any = None,
        *,  # noqa: ANN401
        choices: tuple[str, ...] = (),
        minimum: float | None = None,
    ) -> Any:  # noqa: ANN401
        self.taken.add(key)
        if key not in self.data or self.data[key] is None:
            return default
        value = self.data[key]
        where, line = self.where(key), self.line_of(key)
        if kind == "str":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                self.fail(f"must be a string, got {_kind(value)}", line, where)
            value = str(value)
            if choices and value not in choices:
                self.fail(f"must be one of {', '.join(choices)}; got {value!r}", line, where)
        elif kind in ("int", "float"):
            ok = isinstance(value, int) if kind == "int" else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok:
                self.fail(
                    f"must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}",
                    line,
                    where,
                )
            if minimum is not None and value < minimum:
                self.fail(f"must be >= {minimum:g}, got {value!r}", line, where)
            value = int(value) if kind == "int" else float(value)
        elif kind == "bool":
            if not isinstance(value, bool):
                self.fail(f"must be true or false, got {value!r}", line, where)
        elif kind == "argv":
            if isinstance(value, str):
                value = shlex.split(value)
            if not isinstance(value, list) or not all(
                isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value
            ):
                self.fail("must be a list of strings (or one shell-quoted string)", line, where)
            value = tuple(str(v) for v in value)
        elif kind == "names":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                self.fail("must be a list of names", line, where)
            value = tuple(value)
        elif kind == "env":
            if not isinstance(value, dict):
                self.fail(f"must be a mapping of variable: value, got {_kind(value)}", line, where)
            bad = [
                k
                for k, v in value.items()
                if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None
            ]
            if bad:
                self.fail(f"variable {bad[0]!r} needs a string value", line, where)
            value = {
                k: (("true" if v else "false") if isinstance(v, bool) else str(v))
                for k, v in value.items()
            }
        else:  # pragma: no cover - a programming error in this module
            raise AssertionError(f"unknown kind {kind!r}")
        return value

    def sub(self, key: str) -> _Reader | None:
        self.taken.add(key)
        if self.data.get(key) is None:
            return None
        return _Reader(self.source, self.where(key), self.data[key], self.line_of(key))

    def done(self) -> None:
        for key in self.data:
            if key not in self.taken:
                known = ", ".join(sorted(self.taken))
                self.fail(
                    f"unknown key {key!r}; known keys here: {known}",
                    self.line_of(str(key)),
                    self.where(str(key)),
                )


def _kind(value: Any) -> str:  # noqa: ANN401
    if value is None:
        return "nothing"
    return {
        dict: "a mapping",
        _Lines: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def _sleep(r: _Reader | None) -> SleepConfig:
    if r is None:
        return SleepConfig()
    d = SleepConfig()
    out = SleepConfig(
        level=r.get("level", "str", d.level, choices=SLEEP_LEVELS),
        idle_after=r.get("idle_after", "float", d.idle_after, minimum=0),
        stop_after=r.get("stop_after", "float", d.stop_after, minimum=0),
        weights_level=r.get("weights_level", "int", d.weights_level, minimum=1),
        engine_activity=r.get("engine_activity", "bool", d.engine_activity),
    )
    if out.weights_level > 2:
        r.fail(
            f"must be 1 or 2, got {out.weights_level}",
            r.line_of("weights_level"),
            r.where("weights_level"),
        )
    r.done()
    return out


def _restart(r: _Reader | None) -> RestartConfig:
    if r is None:
        return RestartConfig()
    d = RestartConfig()
    out = RestartConfig(
        policy=r.get("policy", "str", d.policy, choices=RESTART_POLICIES),
        max_restarts=r.get("max_restarts", "int", d.max_restarts, minimum=0),
        window_s=r.get("window_s", "float", d.window_s, minimum=0),
        backoff_s=r.get("backoff_s", "float", d.backoff_s, minimum=0),
        backoff_max_s=r.get("backoff_max_s", "float", d.backoff_max_s, minimum=0),
    )
    r.done()
    return out


def _model(r: _Reader) -> ModelConfig:
    name = r.get("name", "str")
    if name is None:
        r.fail('needs a name (what clients put in the request\'s "model")', r.line, r.path)
    if not _NAME.match(name):
        r.fail(
            f"{name!r} is not a usable name: letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 63 characters (it is also the "
            "kvcached instance name)",
            r.line_of("name"),
            r.where("name"),
        )
    engine = r.get("engine", "str", "vllm", choices=ENGINES)
    d = ModelConfig(name=name)
    m = ModelConfig(
        name=name,
        engine=engine,
        model=r.get("model", "str", ""),
        args=r.get("args", "argv", ()),
        command=r.get("command", "argv", ()),
        aliases=r.get("aliases", "names", ()),
        port=r.get("port", "int", None, minimum=1),
        env=r.get("env", "env", {}),
        start=r.get("start", "str", d.start, choices=START_MODES),
        sleep=_sleep(r.sub("sleep")),
        restart=_restart(r.sub("restart")),
        wake_timeout=r.get("wake_timeout", "float", d.wake_timeout, minimum=0),
        startup_timeout=r.get("startup_timeout", "float", d.startup_timeout, minimum=1),
        stop_timeout=r.get("stop_timeout", "float", d.stop_timeout, minimum=0),
        ready_path=r.get("ready_path", "str", engine_kind(engine).health_path),
        kvcached=r.get("kvcached", "bool", d.kvcached),
    )
    r.done()
    if m.port is not None and m.port > 65535:
        r.fail(f"must be a TCP port (1-65535), got {m.port}", r.line_of("port"), r.where("port"))
    if m.kind.module and not (m.model or m.command):
        r.fail(
            f"engine {engine} needs model (the model path or id to serve) or command "
            "(your own launch command of that engine)",
            r.line,
            r.path,
        )
    if m.command and (m.model or m.args):
        key = "model" if m.model else "args"
        r.fail(
            f"{key} is for the command serve builds; with command, put everything in command",
            r.line_of(key),
            r.where(key),
        )
    if not m.kind.module and not m.command:
        r.fail("engine command needs command: the argv that serves HTTP on {port}", r.line, r.path)
    if m.kind.weights_sleep is None and m.sleep.level == "weights":
        r.fail(
            "sleep level weights needs an engine with a sleep API (vllm or sglang); use kv or stop",
            r.line_of("sleep"),
            r.where("sleep.level"),
        )
    refused = m.kind.reload_refused_by
    if (
        refused is not None
        and m.sleep.level == "weights"
        and m.sleep.weights_level >= 2
        and _arg_value(m.args, refused[0]) == refused[1]
    ):
        r.fail(
            f"weights_level {m.sleep.weights_level} discards the weights and loads them "
            f"again from the model's files on wake; {refused[0]} {refused[1]} has none to "
            "load: use weights_level 1 or real weights",
            r.line_of("sleep"),
            r.where("sleep.weights_level"),
        )
    if not m.ready_path.startswith("/"):
        r.fail(
            f"must be a URL path starting with '/', got {m.ready_path!r}",
            r.line_of("ready_path"),
            r.where("ready_path"),
        )
    return m


def _arg_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value an argv gives ``flag`` (``--flag value`` or ``--flag=value``; the last wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def parse_config(data: Any, source: str = "<config>") -> ServeConfig:  # noqa: ANN401
    """A :class:`ServeConfig` from the YAML document ``data`` (as loaded by
    :func:`load_config`, or a plain dict: then lines read 0)."""
    top = _Reader(source, "", data, 1)
    host = top.get("host", "str", "127.0.0.1")
    port = top.get("port", "int", 8000, minimum=0)
    if port > 65535:
        top.fail(f"must be a TCP port (0-65535), got {port}", top.line_of("port"), "port")
    api_key = top.get("api_key", "str", None)
    api_key_env = top.get("api_key_env", "str", None)
    if api_key and api_key_env:
        top.fail("give api_key or api_key_env, not both", top.line_of("api_key_env"), "api_key_env")
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            top.fail(
                f"names {api_key_env}, which is not set in the environment",
                top.line_of("api_key_env"),
                "api_key_env",
            )
    engine_host = top.get("engine_host", "str", "127.0.0.1")
    state_dir = top.get("state_dir", "str", "")
    pressure = top.get("pressure", "str", "off", choices=PRESSURE_POLICIES)
    idle_check_s = top.get("idle_check_s", "float", 0.25, minimum=0.01)
    on_model_failure = top.get("on_model_failure", "str", "exit", choices=ON_MODEL_FAILURE)
    public_metrics = top.get("public_metrics", "bool", False)
    top.taken.add("models")
    raw_models = data.get("models")
    line = top.line_of("models")
    if not isinstance(raw_models, list) or not raw_models:
        top.fail("needs a list of at least one model", line, "models")
    top.done()
    models = []
    names: dict[str, str] = {}
    ports: dict[int, str] = {}
    for i, raw in enumerate(raw_models):
        r = _Reader(source, f"models[{i}]", raw, line)
        m = _model(r)
        for served in m.served_names:
            if served in names:
                r.fail(
                    f"{served!r} is already the name or an alias of {names[served]}", r.line, r.path
                )
            names[served] = m.name
        if m.port is not None:
            if m.port in ports or m.port == port:
                owner = ports.get(m.port, "the router")
                r.fail(f"port {m.port} is already {owner}'s", r.line_of("port"), r.where("port"))
            ports[m.port] = m.name
        models.append(m)
    return ServeConfig(
        models=tuple(models),
        host=host,
        port=port,
        api_key=api_key,
        engine_host=engine_host,
        state_dir=state_dir,
        pressure=pressure,
        idle_check_s=idle_check_s,
        on_model_failure=on_model_failure,
        public_metrics=public_metrics,
        source=source,
    )


def load_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Read and validate the YAML file at ``path``."""
    import yaml

    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ServeConfigError(f"{source}: cannot read the serve config: {exc.strerror}") from exc
    try:
        data = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark is not None else 0
        raise ServeConfigError(f"{source}:{line}: not valid YAML: {exc.problem}") from exc
    except yaml.YAMLError as exc:
        raise ServeConfigError(f"{source}: not valid YAML: {exc}") from exc
    return parse_config(data, source)


def with_ports(config: ServeConfig, ports: Mapping[str, int]) -> ServeConfig:
    """``config`` with these models' ports filled in."""
    models = tuple(replace(m, port=ports.get(m.name, m.port)) for m in config.models)
    return replace(config, models=models)


def describe(config: ServeConfig) -> str:
    """The plan ``kvcached serve --check`` prints: what would start, where, how it sleeps."""
    lines = [
        f"router   http://{config.host}:{config.port}  (api key: "
        f"{'required' if config.api_key else 'none'}; pressure: {config.pressure})",
        f"state    {config.resolved_state_dir()}",
    ]
    for m in config.models:
        argv = m.argv(config.engine_host, m.port if m.port is not None else "<free port>")
        sleep = m.sleep.level
        if sleep != "none":
            sleep += f" after {m.sleep.idle_after:g} s idle"
            if m.sleep.level == "stop":
                sleep += f", process stopped after {m.sleep.stop_after:g} s asleep"
            if m.sleep.level == "weights" and "{level}" in str(m.kind.weights_sleep):
                sleep += f" (vLLM sleep level {m.sleep.weights_level})"
        lines += [
            "",
            f"model    {m.name}" + (f"  (aliases: {', '.join(m.aliases)})" if m.aliases else ""),
            f"  engine   {m.engine}, start {m.start}, port "
            f"{m.port if m.port is not None else 'auto'}",
            f"  command  {shlex.join(argv)}",
            f"  sleep    {sleep}; wake timeout {m.wake_timeout:g} s",
            f"  restart  {m.restart.policy} (at most {m.restart.max_restarts} in "
            f"{m.restart.window_s:g} s, backoff {m.restart.backoff_s:g}-"
            f"{m.restart.backoff_max_s:g} s)",
        ]
        env = m.environment({})
        if env:
            lines.append(
                "  env      " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
            )
    return "\n".join(lines)

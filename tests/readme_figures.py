"""The measured figures of the README and docs/benchmarks.md, checked against the
result files they come from.

The write-ups of every measurement live in ``docs/benchmarks.md``; the README keeps
a short table of headline figures. Both are checked the same way.

A :class:`Figure` names a piece of a document's text, the committed JSON under
``benchmarks/results/`` it quotes, and the key (or keys) in it. In the text, each
checked number is in braces:

- ``{0.96}``: one value, equal to the file's at the precision shown
  (``0.96`` covers 0.955..0.965);
- ``{0.87–0.95}``: a range over every file the source glob matches that has the key,
  outliers included: the lowest value rounds to the first number, the highest to the
  second (an en dash or a hyphen);
- ``{#eight}``: how many files the glob matched that have the key (a word or digits).

The braces are removed and the rest must appear in the document as it is (whitespace
and ``**`` bold markers ignored). A file whose ``provenance`` has ``stale`` may be
quoted only by text that says "stale"; a file that is not stale only by text that does
not. Every file quoted must carry a provenance block (``benchmarks/_provenance.py``)
naming its commit, command and machine.

:func:`unclaimed` finds the figures nobody checks: every ratio (``1.5x``), time in
``µs``, percentage and bold number in a document's prose (code blocks, HTML comments
and a generated variables table left out) must lie inside some Figure's
text or in an :class:`Unmeasured` entry that says why it is not ours to measure.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

Key = str | Callable[[dict], float | None]

WORDS = {
    w: i
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
NUMBER = r"\d+(?:\.\d+)?"
RANGE = re.compile(rf"^({NUMBER})\s*[–-]\s*({NUMBER})$")
# Figures a reader would take as measured: ratios, microseconds, percentages, bold numbers.
FIGURE_TOKEN = re.compile(rf"(?<![\w.]){NUMBER}(?:\s*[–-]\s*{NUMBER})?(?:x\b|\s?µs\b|%)")


@dataclass(frozen=True)
class Figure:
    """A document's ``text`` with braced figures, checked against ``source`` at ``key``.

    ``source`` is a path or glob relative to ``benchmarks/results`` (or a tuple of them); ``key`` a dotted
    path into the JSON (a number, or a list of numbers that a range covers), or a
    function of the JSON (``None`` when a file lacks it), or
    a tuple with one key per braced figure in order (a ``{#...}`` count uses the key of
    the figure before it, or the first key).
    """

    text: str
    source: str | tuple[str, ...]
    key: Key | tuple[Key, ...]


@dataclass(frozen=True)
class Unmeasured:
    """A document's ``text`` holding a number that is not a figure of ours, and ``why``."""

    text: str
    why: str


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("**", "")).strip()


def readme_prose(readme: str) -> str:
    """A document without fenced code, HTML comments and a generated variables table."""
    text = re.sub(r"<!-- variables:begin -->.*?<!-- variables:end -->", " ", readme, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    return re.sub(r"^(```|~~~).*?^\1\s*$", " ", text, flags=re.S | re.M)


def lookup(data: dict, key: Key) -> list[float] | None:
    """The number (or list of numbers, e.g. a ``[min, max]``) at ``key``; None if absent."""
    if callable(key):
        node: Any = key(data)
    else:
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
    if node is None:
        return None
    items = node if isinstance(node, list) else [node]
    if not items or any(isinstance(x, bool) or not isinstance(x, int | float) for x in items):
        raise AssertionError(f"key {key!r} is {node!r}, not a number or a list of numbers")
    return [float(x) for x in items]


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AssertionError(f"{path.relative_to(ROOT)}: not readable JSON ({e})") from e


def files_of(source: str | tuple[str, ...]) -> list[Path]:
    patterns = (source,) if isinstance(source, str) else source
    return sorted({Path(p) for s in patterns for p in glob.glob(str(RESULTS / s))})


def _decimals(shown: str) -> int:
    return len(shown.split(".")[1]) if "." in shown else 0


def rounds_to(value: float, shown: str) -> bool:
    """``value`` printed at ``shown``'s precision could read ``shown`` (either half way)."""
    return abs(value - float(shown)) <= 0.5 * 10.0 ** -_decimals(shown) + 1e-9


COMPANION_SUFFIXES = ("-requests", "-trace")


def provenance_problems(path: Path, data: dict | list) -> list[str]:
    name = path.relative_to(ROOT)
    for suffix in COMPANION_SUFFIXES:
        # X-requests.json / X-trace.json are the raw data of X.json, which records them.
        if (
            path.stem.endswith(suffix)
            and path.with_name(path.stem[: -len(suffix)] + ".json").exists()
        ):
            return []
    if isinstance(data, list):
        # A table of rows (compat.json): each row records where it came from.
        return [
            f"{name}: row {i} has no {field}"
            for i, row in enumerate(data)
            for field in ("commit", "command", "date")
            if not row.get(field)
        ]
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        return [f"{name}: no provenance block (write it through benchmarks/_provenance.py)"]
    problems = [
        f"{name}: provenance has no {field}"
        for field in ("commit", "command", "machine")
        if not prov.get(field)
    ]
    if str(prov.get("commit", "")).startswith("unknown"):
        problems.append(f"{name}: provenance commit is {prov['commit']!r}")
    if "load_average_start" not in prov:
        problems.append(f"{name}: provenance has no load_average_start")
    return problems


def check(figure: Figure, readme: str, doc: str = "README") -> list[str]:
    """What is wrong with ``figure`` against ``readme`` (the text of ``doc``) and its
    files (empty: all true)."""
    plain = PLACEHOLDER.sub(lambda m: m.group(1).lstrip("#"), figure.text)
    where = f"{doc} text {normalize(plain)!r}"
    problems = []
    if normalize(plain) not in normalize(readme):
        problems.append(f"{where} is not in {doc} (reworded? update its Figure)")
    paths = files_of(figure.source)
    if not paths:
        return problems + [f"{where}: no file matches benchmarks/results/{figure.source}"]
    data = {p: load(p) for p in paths}
    for p, d in data.items():
        problems += provenance_problems(p, d)
    stale = [p for p, d in data.items() if (d.get("provenance") or {}).get("stale")]
    says_stale = "stale" in plain.lower()
    if stale and not says_stale:
        problems.append(
            f"{where} quotes {', '.join(str(p.relative_to(ROOT)) for p in stale)} "
            f"as current, but it is marked stale: re-measure it or say 'stale'"
        )
    if says_stale and not stale:
        problems.append(f"{where} says stale, but its files are not: drop the word")
    keys = figure.key if isinstance(figure.key, tuple) else (figure.key,)
    numeric = [m for m in PLACEHOLDER.finditer(figure.text) if not m.group(1).startswith("#")]
    if len(keys) not in (1, len(numeric)):
        return problems + [f"{where}: {len(keys)} keys for {len(numeric)} braced figures"]
    last_key = keys[0]
    index = 0
    for m in PLACEHOLDER.finditer(figure.text):
        shown = m.group(1).strip()
        if shown.startswith("#"):
            values = [v for v in (lookup(d, last_key) for d in data.values()) if v is not None]
            word = shown[1:].strip().lower()
            want = int(word) if word.isdigit() else WORDS.get(word)
            if want is None:
                problems.append(f"{where}: count {shown!r} is not a number word")
            elif want != len(values):
                problems.append(
                    f"{where}: says {word} runs, {len(values)} files have "
                    f"{last_key!r} ({figure.source})"
                )
            continue
        key = keys[index] if len(keys) > 1 else keys[0]
        last_key, index = key, index + 1
        values = [x for d in data.values() for x in (lookup(d, key) or [])]
        if not values:
            problems.append(f"{where}: no file of {figure.source} has {key!r}")
            continue
        got = RANGE.match(shown)
        if got:
            lo, hi = got.groups()
            if not (rounds_to(min(values), lo) and rounds_to(max(values), hi)):
                problems.append(
                    f"{where}: {shown} is not the range of {key!r} over "
                    f"{figure.source}: {min(values):g}..{max(values):g} "
                    f"({len(values)} values)"
                )
        elif re.fullmatch(NUMBER, shown):
            if len(values) != 1:
                problems.append(
                    f"{where}: {shown} is one value, {len(values)} files have "
                    f"{key!r}: show their range"
                )
            elif not rounds_to(values[0], shown):
                problems.append(
                    f"{where}: {shown}, but {figure.source} has {key!r} = {values[0]:g}"
                )
        else:
            problems.append(f"{where}: {{{shown}}} is neither a number nor a range")
    return problems


def unclaimed(readme: str, claims: Iterable[str]) -> list[str]:
    """Figure-like tokens of a document's prose that no claimed text covers."""
    prose = normalize(readme_prose(readme))
    covered = [False] * len(prose)
    for text in claims:
        plain = normalize(PLACEHOLDER.sub(lambda m: m.group(1).lstrip("#"), text))
        for m in re.finditer(re.escape(plain), prose):
            covered[m.start() : m.end()] = [True] * (m.end() - m.start())
    # Bold markers were removed by normalize(); find bold numbers in the raw prose instead.
    raw = re.sub(r"\s+", " ", readme_prose(readme))
    tokens = [
        m.group(0) for m in FIGURE_TOKEN.finditer(prose) if not all(covered[m.start() : m.end()])
    ]
    for m in re.finditer(r"\*\*(.+?)\*\*", raw):
        inner = normalize(m.group(1))
        if not re.search(r"\d", inner):
            continue
        spans = [k.start() for k in re.finditer(re.escape(inner), prose)]
        if spans and not any(all(covered[s : s + len(inner)]) for s in spans):
            tokens.append(f"**{inner}**")
    return sorted(set(tokens))

"""Pool separate ``vllm_gpu.py`` calls into one result, so that a start order's
bias cancels: the three servers start one after another, and in eager runs on
the H100 their mean TPOT ranked in that order (ec77bdf: the first slowest, the
last fastest, about 2% apart each). A call with kvcached first
(``candidate,baseline,control``, the default) and one with it last
(``control,baseline,candidate``) put the candidate and the control each once in
either end place and the baseline in the middle both times; pooled, a place's
effect falls on the candidate and the control alike, so the candidate's ratio
less the control's is kvcached's own cost.

    python benchmarks/vllm_gpu_merge.py OUT.json PART.json PART.json [--equal-rounds]

Every part must have run the same model, trace, server arguments and card.
``--equal-rounds`` keeps each start order's first N rounds, N the fewest any
order ran, so that neither order weighs more in the pool. The result has
``vllm_gpu.py``'s blocks (``throughput_ratio``…, ``control``, ``pooled``,
``per_round``) over the pooled rounds, ``rounds_by_start_order``, whether the
candidate's and the control's places mirror each other (``balanced``), and
each part's provenance under ``parts``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import _provenance
from vllm_gpu import TOGETHER, per_round, pooled, ratios

#: keys every part must share: the same servers under the same load
SAME = ("model", "trace", "candidate_env")


def _device(result: dict[str, Any]) -> str | None:
    return ((result.get("provenance") or {}).get("machine") or {}).get("device")


def _server_args(result: dict[str, Any]) -> str:
    """The part's ``--device-args`` and ``--native-util`` as its command gave them."""
    words = ((result.get("provenance") or {}).get("command") or "").split()
    keep = []
    for i, word in enumerate(words):
        for flag in ("--device-args", "--native-util"):
            if word == flag and i + 1 < len(words):
                keep.append(f"{flag}={words[i + 1]}")
            elif word.startswith(flag + "="):
                keep.append(word)
    return " ".join(sorted(keep))


def balanced(orders: list[list[str]]) -> bool:
    """Whether, over ``orders`` (one per pooled round), the candidate took each
    start place exactly as often as the control did (servers started together
    have no place)."""
    placed = [o for o in orders if o != [TOGETHER]]
    for place in range(3):
        cand = sum(o[place] == "candidate" for o in placed)
        ctrl = sum(o[place] == "control" for o in placed)
        if cand != ctrl:
            return False
    return True


def merge(parts: list[Path], equal_rounds: bool = False) -> dict[str, Any]:
    """The pooled result of ``parts``. Raises ValueError naming the part that
    does not match the first (model, trace, server arguments, card, commit)."""
    if len(parts) < 2:
        raise ValueError(f"parts={[str(p) for p in parts]}: merging needs two results or more")
    results = [json.loads(p.read_text()) for p in parts]
    first = results[0]
    for path, result in zip(parts, results, strict=True):
        if "rounds" not in result or "start_order" not in result:
            raise ValueError(f"{path}: not a vllm_gpu.py result with start_order (since 583b100)")
        for key in SAME:
            if result.get(key) != first.get(key):
                raise ValueError(f"{path}: {key} is {result.get(key)!r}, {parts[0]} has "
                                 f"{first.get(key)!r}")  # fmt: skip
        for what, get in (("server arguments", _server_args), ("device", _device)):
            if get(result) != get(first):
                raise ValueError(f"{path}: {what} {get(result)!r}, {parts[0]} has {get(first)!r}")
        commit = (result.get("provenance") or {}).get("commit")
        if commit != (first.get("provenance") or {}).get("commit"):
            raise ValueError(f"{path}: measured commit {commit}, {parts[0]} another: pool runs "
                             "of one commit")  # fmt: skip
    by_order: dict[str, list[dict]] = {}
    for result in results:
        by_order.setdefault(",".join(result["start_order"]), []).extend(result["rounds"])
    if equal_rounds:
        n = min(len(r) for r in by_order.values())
        by_order = {order: rounds[:n] for order, rounds in by_order.items()}
    rounds = [{**r, "start_order": order} for order, rs in by_order.items() for r in rs]
    if not rounds:
        raise ValueError(f"{[str(p) for p in parts]}: no rounds to pool")
    orders = [r["start_order"].split(",") for r in rounds]
    return {
        "complete": all(r.get("complete") for r in results),
        **ratios(rounds, "candidate"),
        "control": ratios(rounds, "control"),
        "pooled": {r: pooled(rounds, r) for r in ("candidate", "control")},
        "per_round": {r: per_round(rounds, r) for r in ("candidate", "control")},
        "rounds_by_start_order": {order: len(rs) for order, rs in by_order.items()},
        "balanced": balanced(orders),
        "equal_rounds": equal_rounds,
        "rounds": rounds,
        **{key: first.get(key) for key in SAME},
        "parts": [
            {
                "file": path.name,
                "start_order": r["start_order"],
                "rounds": len(r["rounds"]),
                "complete": r.get("complete"),
                "provenance": r.get("provenance"),
            }
            for path, r in zip(parts, results, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("parts", type=Path, nargs="+")
    ap.add_argument("--equal-rounds", action="store_true")
    args = ap.parse_args(argv)
    try:
        result = merge(args.parts, args.equal_rounds)
        # The pooled figures measure the parts' commit on the parts' machine under
        # the parts' load; this command only did arithmetic over them.
        parts = result["parts"]
        block = _provenance.merged([p["provenance"] for p in parts], [p["file"] for p in parts])
    except ValueError as exc:
        raise SystemExit(f"vllm_gpu_merge: {exc}") from None
    block["merged_by"] = _provenance.command(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "provenance": block}, indent=2) + "\n")
    keys = ("balanced", "rounds_by_start_order", "throughput_ratio", "pooled")
    print(json.dumps({k: result[k] for k in keys}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

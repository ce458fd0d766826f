"""``kvcached info``: the first command a user runs.

It names the backend and the device, its granularity and memory, then proves
the driver works end to end: reserve address space, create and map a few
pages, write through a tensor that aliases them and read the data back, unmap,
release, free the reservation, timing every driver call.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvcached.config import get_config
from kvcached.driver import Driver, default_driver
from kvcached.errors import KVCachedError
from kvcached.units import format_bytes

CALLS = ("reserve", "create", "map", "set_access", "unmap", "release", "free_reservation")


@dataclass
class CheckResult:
    """What the end-to-end check saw: the per-call cost (p50, µs) and whether
    the data written through the tensor came back."""

    pages: int
    data_ok: bool = False
    unmapped_reads_zero: bool = False
    call_us: dict[str, float] = field(default_factory=dict)


def run_check(driver: Driver, pages: int = 8) -> CheckResult:
    """Reserve ``pages + 2`` granules, map ``pages`` of them, write and read back.

    Every resource is undone in reverse if a step fails, and the error is raised.
    """
    import torch

    gran = driver.granularity
    times: dict[str, list[float]] = {call: [] for call in CALLS}
    result = CheckResult(pages=pages)
    undo: list[Any] = []

    def timed(call: str, fn, *args):
        start = time.perf_counter()
        value = fn(*args)
        times[call].append((time.perf_counter() - start) * 1e6)
        return value

    size = (pages + 2) * gran
    va = timed("reserve", driver.reserve, size)
    undo.append(lambda: timed("free_reservation", driver.free_reservation, va, size))
    try:
        for i in range(pages):
            handle = timed("create", driver.create, gran)
            undo.append(lambda h=handle: timed("release", driver.release, h))
            page_va = va + (i + 1) * gran
            timed("map", driver.map, page_va, gran, handle)
            undo.append(lambda p=page_va: timed("unmap", driver.unmap, p, gran))
            timed("set_access", driver.set_access, page_va, gran)
        raw = driver.tensor(va + gran, pages * gran)
        words = raw.view(torch.int32).view(pages, gran // 4)
        pattern = torch.arange(1, pages + 1, dtype=torch.int32, device=raw.device)
        words.copy_(pattern[:, None].expand(pages, gran // 4))
        driver.synchronize()
        result.data_ok = bool((words[:, ::997] == pattern[:, None]).all().item())
        del raw, words
        driver.synchronize()
        while len(undo) > 1:  # unmap and release every page, keep the reservation
            undo.pop()()
        if driver.backend == "host":
            # unmapped host ranges read as zeros (a GPU would fault instead)
            result.unmapped_reads_zero = int(driver.tensor(va, size).sum()) == 0
        else:
            result.unmapped_reads_zero = True
    finally:
        while undo:
            undo.pop()()
    result.call_us = {c: round(statistics.median(v), 2) for c, v in times.items() if v}
    return result


def info(as_json: bool = False, pages: int = 8, backend: str | None = None) -> int:
    """Print what kvcached sees and prove the driver works; return the exit code."""
    try:
        driver = default_driver(backend, config=get_config())
        device = driver.info()
        free, total = driver.mem_info()
        check = run_check(driver, pages)
    except KVCachedError as exc:
        return _fail(as_json, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # any other failure is still a failed check, said plainly
        return _fail(as_json, f"unexpected {type(exc).__name__}: {exc}")
    ok = check.data_ok and check.unmapped_reads_zero
    report = {
        "ok": ok,
        "device": device.as_dict(),
        "free_bytes": free,
        "total_bytes": total,
        "check": {
            "pages": check.pages,
            "data_ok": check.data_ok,
            "unmapped_reads_zero": check.unmapped_reads_zero,
            "call_us_p50": check.call_us,
        },
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"backend      {device.backend}")
        print(f"device       {device.index}: {device.name}")
        print(f"bus id       {device.pci_bus_id}")
        print(f"granularity  {format_bytes(device.granularity)}")
        print(f"memory       {format_bytes(free)} free of {format_bytes(total)}")
        print(
            f"check        {check.pages} pages mapped, written and read back: "
            f"{'ok' if check.data_ok else 'DATA MISMATCH'}"
        )
        print("driver calls (p50 per call):")
        for call, us in check.call_us.items():
            print(f"  {call:<17}{us:>10.2f} µs")
    if not ok:
        print(
            "kvcached info: the data read back differs from what was written, or an "
            "unmapped range did not read zeros",
            file=sys.stderr,
        )
    return 0 if ok else 1


def _fail(as_json: bool, reason: str) -> int:
    if as_json:
        print(json.dumps({"ok": False, "error": reason}, indent=2))
    print(f"kvcached info: {reason}", file=sys.stderr)
    return 1

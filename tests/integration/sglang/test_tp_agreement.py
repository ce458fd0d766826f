"""TP agreement: one budget per scheduling round for every rank.

Unit tests drive :class:`RoundAgreement` with an in-process reducer; the
multi-process tests start 2-4 real ranks on a torch.distributed gloo group
(loopback only), each rank with a real kvcached pool on a host-backend device
of its own capacity and its own ledger (tp_round_worker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.integrations.sglang.tp_agreement import RoundAgreement

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("tp_round_worker.py")


class SharedReducer:
    """The reduce of several ranks faked in one process: rank values are set
    beforehand, the call returns their min/max with this rank's value in."""

    def __init__(self, others: list[int], other_failures: int = 0) -> None:
        self.others = others
        self.other_failures = other_failures
        self.calls: list[tuple[str, int]] = []

    @property
    def active(self) -> bool:
        return True

    def all_reduce_min(self, value: int) -> int:
        self.calls.append(("min", value))
        return min([value, *self.others])

    def all_reduce_max(self, value: int) -> int:
        self.calls.append(("max", value))
        return max(value, self.other_failures)


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.value


def test_round_serves_the_smallest_rank_plus_its_own_tally() -> None:
    local = Counter(100)
    reducer = SharedReducer(others=[40, 70])
    agreement = RoundAgreement(local, reducer)
    with agreement.round():
        assert agreement.available() == 40
        local.value = 5  # the live count moves (this GPU filled up) ...
        assert agreement.available() == 40  # ... the round does not look
        agreement.note_alloc(30)
        agreement.note_free(4)
        assert agreement.available() == 14
        agreement.note_alloc(50)
        assert agreement.available() == 0  # floored, never negative
    assert agreement.available() == 5  # outside a round: live
    assert reducer.calls == [("min", 100)]


def test_only_the_outermost_round_reduces() -> None:
    reducer = SharedReducer(others=[10])
    agreement = RoundAgreement(Counter(50), reducer)
    with agreement.round():
        agreement.note_alloc(3)
        with agreement.round():  # e.g. get_new_batch_prefill inside get_next_batch_to_run
            assert agreement.available() == 7
        assert agreement.in_round and agreement.available() == 7
    assert not agreement.in_round
    assert [c[0] for c in reducer.calls] == ["min"] and agreement.stats.rounds == 1


def test_reduce_runs_whatever_the_local_count() -> None:
    """Same collectives in the same order on every rank: no local shortcut."""
    for value in (0, 10**9, -3):
        reducer = SharedReducer(others=[5])
        agreement = RoundAgreement(Counter(value), reducer)
        with agreement.round():
            pass
        assert reducer.calls == [("min", max(value, 0))]


def test_agree_is_a_miss_everywhere_when_any_rank_failed() -> None:
    reducer = SharedReducer(others=[10], other_failures=1)
    agreement = RoundAgreement(Counter(50), reducer)
    with agreement.round():
        assert agreement.agree(True) is False  # another rank failed
    assert agreement.stats.agreed_misses == 1
    reducer.other_failures = 0
    with agreement.round():
        assert agreement.agree(True) is True
        assert agreement.agree(False) is False
    assert [c for c in reducer.calls if c[0] == "max"] == [("max", 0), ("max", 0), ("max", 1)]


def test_outside_a_round_everything_is_local() -> None:
    reducer = SharedReducer(others=[1])
    agreement = RoundAgreement(Counter(50), reducer)
    agreement.note_alloc(10)  # ignored: no round
    assert agreement.available() == 50
    assert agreement.agree(False) is False and agreement.agree(True) is True
    assert reducer.calls == []


def test_single_rank_never_reduces() -> None:
    class Inactive(SharedReducer):
        @property
        def active(self) -> bool:
            return False

    local = Counter(50)
    reducer = Inactive(others=[1])
    agreement = RoundAgreement(local, reducer)
    assert not agreement.distributed
    with agreement.round():
        local.value = 20
        assert agreement.available() == 20  # TP=1: the live count
        assert agreement.agree(False) is False
    assert reducer.calls == []


def test_misuse_is_reported() -> None:
    with pytest.raises(TypeError, match="local_available"):
        RoundAgreement(42, None)  # type: ignore[arg-type]
    agreement = RoundAgreement(Counter(1), None)
    with pytest.raises(ValueError, match="count"):
        agreement.note_alloc(-1)
    with pytest.raises(AssertionError, match="end_round without begin_round"):
        agreement.end_round()


# -- real processes ----------------------------------------------------------------


def run_ranks(tmp_path: Path, world: int, capacities: list[int], *extra: str) -> list[dict]:
    store = tmp_path / "store"
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", KVCACHED_LOG_LEVEL="WARNING"
    )
    procs = []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        cmd = [
            sys.executable,
            str(WORKER),
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--store",
            str(store),
            "--capacities",
            ",".join(map(str, capacities)),
            "--out",
            str(out),
            "--ledger-dir",
            str(tmp_path / "ledgers"),
            *extra,
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{text}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def batches(record: dict) -> list[list[int]]:
    return [r["admitted"] for r in record["rounds"]]


@pytest.mark.slow  # a process per rank, 60 rounds over gloo: 10-18 s each on 2 cores
@pytest.mark.parametrize(
    ("world", "capacities", "extra"),
    [
        (2, [28, 64], ()),
        (3, [48, 28, 72], ("--shrink", "1:8,1:9,1:10,1:11,1:20,1:21,1:22,1:33,1:34")),
        (4, [64, 36, 28, 84], ("--grid", "--shrink", "2:12,2:13,2:14,0:25,0:26,0:27")),
    ],
    ids=["tp2", "tp3-shrink", "tp2xcp2-shrink"],
)
def test_ranks_admit_the_same_batches(
    tmp_path: Path, world: int, capacities: list[int], extra: tuple
) -> None:
    records = run_ranks(tmp_path, world, capacities, "--rounds", "60", *extra)
    reference = batches(records[0])
    assert sum(len(b) for b in reference) > 20, "the stream admitted too little to test anything"
    for record in records[1:]:
        assert batches(record) == reference, f"rank {record['rank']} admitted other batches"

    shrunk = {(r["round"], rec["rank"]) for rec in records for r in rec["rounds"] if r["shrunk"]}
    for record in records:
        for r in record["rounds"]:
            # A rank with less headroom never fails what the others allocated:
            # only a capacity lost mid-round can make a local allocation fail.
            if r["local_failures"]:
                assert (r["round"], record["rank"]) in shrunk, (record["rank"], r)
        # One MIN reduce per round, one MAX reduce per attempt.
        stats = record["stats"]
        attempts = sum(len(r["admitted"]) + len(r["misses"]) for r in record["rounds"])
        assert stats["min_reduces"] == stats["rounds"] == 60
        assert stats["max_reduces"] == attempts
        # Freed pages went back to the rank's ledger: only the padding page stays.
        assert record["pages_left_mapped"] == 1, record["pages_left_mapped"]

    # The agreed budget really was the smallest rank's: some round admitted
    # under a budget below what a roomier rank had locally.
    assert any(
        r["agreed"] < max(rec["rounds"][i]["local_at_begin"] for rec in records)
        for i, r in enumerate(records[0]["rounds"])
    )
    if shrunk:
        misses = [r["misses"] for r in records[0]["rounds"]]
        assert any(misses), "no injected shrink produced a miss: the test lost its teeth"
        for record in records[1:]:
            assert [r["misses"] for r in record["rounds"]] == misses


@pytest.mark.slow  # two rank processes over gloo, ~9 s
def test_without_agreement_ranks_diverge(tmp_path: Path) -> None:
    """Negative control: each rank reading its own count admits other batches."""
    records = run_ranks(tmp_path, 2, [28, 64], "--rounds", "60", "--mode", "local")
    assert batches(records[0]) != batches(records[1])

"""One TP rank running scheduling rounds over a torch.distributed gloo group.

Started by test_tp_agreement.py, one process per rank. Every rank sees the same
request stream (same seed), as SGLang's TP ranks do, but owns a pool of its own
capacity, as each rank owns its GPU. Each round the rank:

1. opens a round (``RoundAgreement.begin_round``: one MIN all-reduce),
2. frees the requests that finished (tallied as frees of the round),
3. optionally loses capacity mid-round (another process grabbed memory on
   that GPU: the ``--shrink`` injection),
4. admits waiting requests FIFO while they fit ``available()``; each admitted
   request allocates physically on this rank and ``agree()`` (one MAX
   all-reduce) turns a local failure into a miss on every rank,
5. records the batch it admitted.

It writes its record as JSON. ``--mode local`` replaces the agreement with the
rank's own live count (no reduce): the negative control, whose ranks must
disagree for the test to mean anything.

The pool here is a counter; once kvcached.memory lands, the same loop runs on
the host backend's block manager with per-rank budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from datetime import timedelta
from pathlib import Path


class CounterPool:
    """A rank's physical headroom in abstract units."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def available(self) -> int:
        return max(self.capacity - self.used, 0)

    def alloc(self, n: int) -> bool:
        if n > self.available():
            return False
        self.used += n
        return True

    def free(self, n: int) -> None:
        assert 0 <= n <= self.used, "freeing more than was allocated"
        self.used -= n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--capacities", required=True, help="comma list, one per rank")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--mode", choices=("agreed", "local"), default="agreed")
    parser.add_argument("--grid", action="store_true", help="reduce over TP then CP groups (world 4)")
    parser.add_argument("--shrink", default="", help="rank:round:units capacity lost mid-round")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    from kvcached.integrations.sglang.tp_agreement import GroupReducer, RoundAgreement

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    if args.grid:
        assert args.world == 4, "--grid lays 4 ranks out as attention TP 2 x CP 2"
        # Every rank creates every group, in the same order (torch's rule).
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = [tp_groups[args.rank // 2], cp_groups[args.rank % 2]]
    else:
        groups = [dist.group.WORLD]

    capacity = int(args.capacities.split(",")[args.rank])
    pool = CounterPool(capacity)
    reducer = GroupReducer(groups) if args.mode == "agreed" else None
    agreement = RoundAgreement(pool.available, reducer)
    shrink = {}
    if args.shrink:
        for item in args.shrink.split(","):
            rank, rnd, units = (int(x) for x in item.split(":"))
            shrink[(rank, rnd)] = units

    rng = random.Random(args.seed)
    waiting: list[dict] = []
    running: list[dict] = []
    next_rid = 0
    record = {"rank": args.rank, "capacity": capacity, "rounds": []}
    for rnd in range(args.rounds):
        for _ in range(rng.randint(0, 3)):
            waiting.append({"rid": next_rid, "size": rng.randint(1, 12), "life": rng.randint(1, 5)})
            next_rid += 1
        with agreement.round():
            local_at_begin = pool.available()
            agreed = agreement.available()
            for req in [r for r in running if r["end"] <= rnd]:
                running.remove(req)
                pool.free(req["size"])
                agreement.note_free(req["size"])
            lost = shrink.get((args.rank, rnd), 0)
            pool.capacity -= lost
            admitted, failures, misses = [], [], []
            while waiting and waiting[0]["size"] <= agreement.available():
                req = waiting[0]
                ok = pool.alloc(req["size"])
                if not ok:
                    failures.append(req["rid"])
                if not agreement.agree(ok):
                    if ok:  # the others missed: undo ours, as every rank does
                        pool.free(req["size"])
                    misses.append(req["rid"])
                    break
                waiting.pop(0)
                agreement.note_alloc(req["size"])
                req["end"] = rnd + req["life"]
                running.append(req)
                admitted.append(req["rid"])
            pool.capacity += lost
            record["rounds"].append({
                "round": rnd,
                "local_at_begin": local_at_begin,
                "agreed": agreed,
                "admitted": admitted,
                "local_failures": failures,
                "misses": misses,
                "shrunk": lost,
            })
    stats = agreement.stats
    record["stats"] = {
        "rounds": stats.rounds,
        "min_reduces": stats.min_reduces,
        "max_reduces": stats.max_reduces,
        "agreed_misses": stats.agreed_misses,
    }
    Path(args.out).write_text(json.dumps(record))
    # Leave together: a rank tearing gloo down while a peer is still running
    # its last rounds (the local mode has no per-round collective) must not
    # break the peer's connections.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One TP rank running scheduling rounds over a torch.distributed gloo group.

Started by test_tp_agreement.py, one process per rank. Every rank sees the same
request stream (same seed), as SGLang's TP ranks do, but owns a real kvcached
pool on a device of its own: a host-backend device (its own index, its own
capacity, so the ranks have different headroom) with its own per-device
ledger, under an :class:`ElasticKV` and the integration's
:class:`SlotAllocator` (the state SGLang's elastic allocators keep). Each round
the rank:

1. opens a round (``SlotAllocator.begin_round``: one MIN all-reduce),
2. frees the requests that finished (tallied as frees of the round),
3. optionally loses capacity mid-round: another pool on the same device's
   ledger grabs memory (another engine on that GPU, the ``--shrink``
   injection),
4. admits waiting requests FIFO while they fit ``available_tokens()``; each
   admitted request allocates its pages (mapped on demand through the
   ledger), and the allocation's agreement (one MAX all-reduce) turns a local
   failure into a miss on every rank,
5. records the batch it admitted.

It writes its record as JSON. ``--mode local`` gives the allocator no reducer
(every rank reads its own count): the negative control, whose ranks must
disagree for the test to mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from datetime import timedelta
from pathlib import Path

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--capacities", required=True, help="comma list of MiB, one per rank")
    parser.add_argument("--ledger-dir", required=True)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--mode", choices=("agreed", "local"), default="agreed")
    parser.add_argument(
        "--grid", action="store_true", help="reduce over TP then CP groups (world 4)"
    )
    parser.add_argument(
        "--shrink", default="", help="rank:round,... another pool takes all headroom mid-round"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from kvcached.driver.host import HostDriver
    from kvcached.integrations.sglang.elastic_kv import ElasticKV, KVShape
    from kvcached.integrations.sglang.slots import SlotAllocator
    from kvcached.integrations.sglang.tp_agreement import GroupReducer
    from kvcached.ledger import Ledger

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

    capacity = int(args.capacities.split(",")[args.rank]) * MIB
    # Each rank is its own "GPU": its own device id, capacity and ledger.
    driver = HostDriver(index=60 + args.rank, capacity=capacity)
    ledger_dir = Path(args.ledger_dir) / f"rank{args.rank}"
    ledger_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger.open(driver.info().pci_bus_id, driver, directory=str(ledger_dir))
    budget = ledger.register_pool(f"tp-rank{args.rank}")
    other = ledger.register_pool("other-engine")  # grabs memory for --shrink
    # One block = one SGLang page of 256 tokens x 8 heads x 128 dims (fp16):
    # 512 KiB per buffer, 4 blocks per 2 MiB kvcached page.
    shape = KVShape(
        layers=1, block_tokens=256, size=256 * 400, heads=8, head_dim=128, dtype=torch.float16
    )
    kv = ElasticKV(
        shape,
        name="kv",
        driver=driver,
        budget=budget,
        register=None,
        min_reserved=0,
        max_reserved=0,
        background=False,
        max_handle_bytes=0,
    )
    slots = SlotAllocator(kv, 400)
    if args.mode == "agreed":
        slots.attach(GroupReducer(groups))
    shrink = {}
    if args.shrink:
        for item in args.shrink.split(","):
            rank, rnd = (int(x) for x in item.split(":"))
            shrink[(rank, rnd)] = True

    rng = random.Random(args.seed)
    waiting: list[dict] = []
    running: list[dict] = []
    next_rid = 0
    record = {"rank": args.rank, "capacity": capacity, "rounds": []}
    for rnd in range(args.rounds):
        for _ in range(rng.randint(0, 3)):
            waiting.append({"rid": next_rid, "size": rng.randint(1, 12), "life": rng.randint(1, 5)})
            next_rid += 1
        slots.begin_round()
        try:
            local_at_begin = slots.local_available_tokens() // shape.block_tokens
            agreed = slots.available_tokens() // shape.block_tokens
            for req in [r for r in running if r["end"] <= rnd]:
                running.remove(req)
                slots.free_blocks(req["pages"])
            lost = 0
            if shrink.get((args.rank, rnd)):
                lost = budget.headroom() // (2 * MIB) * (2 * MIB)
                if lost and not other.grant(lost):
                    lost = 0
            admitted, failures, misses = [], [], []
            while waiting and waiting[0]["size"] * shape.block_tokens <= slots.available_tokens():
                req = waiting[0]
                before = slots.local_failures
                pages = slots.alloc_blocks(req["size"])
                if pages is None:
                    if slots.local_failures > before:  # this rank's ledger said no
                        failures.append(req["rid"])
                    misses.append(req["rid"])
                    break
                waiting.pop(0)
                req["pages"] = pages
                req["end"] = rnd + req["life"]
                running.append(req)
                admitted.append(req["rid"])
            if lost:
                other.refund(lost)
                other.flush()
        finally:
            slots.end_round()
        record["rounds"].append(
            {
                "round": rnd,
                "local_at_begin": local_at_begin,
                "agreed": agreed,
                "admitted": admitted,
                "local_failures": failures,
                "misses": misses,
                "shrunk": lost,
            }
        )
    stats = slots.agreement.stats
    record["stats"] = {
        "rounds": stats.rounds,
        "min_reduces": stats.min_reduces,
        "max_reduces": stats.max_reduces,
        "agreed_misses": stats.agreed_misses,
    }
    for req in running:
        slots.free_blocks(req["pages"])
    record["pages_left_mapped"] = kv.cache.usage().pages_mapped
    kv.close()
    other.close()
    budget.close()
    ledger.close()
    Path(args.out).write_text(json.dumps(record))
    # Leave together: a rank tearing gloo down while a peer is still running
    # its last rounds (the local mode has no per-round collective) must not
    # break the peer's connections.
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo's C++ threads, torn down there, abort
    # the process now and then ("terminate called without an active
    # exception", SIGABRT; seen once in CI on 2 loaded cores) after every
    # result is written and every collective done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

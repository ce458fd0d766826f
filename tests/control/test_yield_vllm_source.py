"""The vLLM engine core's side of the yield pass (``KVCACHED_YIELD_IDLE``): its
device watch posts and reads calls on the real ledger, its source reports the
capacity check's shortfall and holds the planner's reserve. No vLLM needed."""

from __future__ import annotations

from kvcached.control.instance import Instance
from kvcached.driver.host import HostDriver
from kvcached.integrations.vllm.control import DeviceWatch, EngineContext, VllmPoolSource
from kvcached.integrations.vllm.planner import StepPlanner, planner_geometry
from kvcached.ledger import Ledger
from kvcached.ledger.layout import H_BUDGET
from kvcached.memory.composite_budget import CompositeBudget
from kvcached.units import MIB


def test_two_ranks_on_one_device_call_once_and_report_their_shortfall(tmp_path):
    driver = HostDriver(index=44, capacity=512 * MIB)
    device = driver.info().pci_bus_id
    ledger = Ledger.open(device, driver, directory=str(tmp_path))
    ranks = [ledger.register_pool("engine"), ledger.register_pool("engine")]
    other = ledger.register_pool("neighbour")
    instance = Instance("engine", engine="test", start=False, yield_idle=True)
    try:
        g = planner_geometry(16, 8, 4 * MIB, 2 * MIB)
        planner = StepPlanner(g, CompositeBudget(ranks, [device, device]), min_reserved=2)
        ctx = EngineContext(
            planner,
            instance=instance,
            devices=[device, device],
            backend="host",
            pools=ranks,
            ledgers=[ledger],
        )
        source = VllmPoolSource(ctx, device, 2)
        watch = DeviceWatch(ranks)
        with ledger.locked():
            ledger.i64[H_BUDGET] = ledger.charged_total()  # nothing left to grant
        planner.note_miss(9)  # nine blocks short: two pages of eight
        usage = source.pool_usage()
        assert usage.misses == 1
        assert usage.short_bytes == 2 * 4 * MIB * 2  # whole pages, on both ranks
        assert watch.post_want(usage.short_bytes)
        (want,) = other.neighbour_wants()
        assert (want.slot, want.nbytes) == (ranks[0].slot, usage.short_bytes)
        assert watch.neighbour_wants() == []  # its own call, on either rank's record
        assert watch.device_room() == 0
        source.hold_reserve(1.0)
        assert planner.pages.reserve_held
        planner.close()
    finally:
        instance.close()
        other.close()
        for pool in ranks:
            pool.close()
        ledger.close()

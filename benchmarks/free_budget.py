"""A physical budget that always grants, for the benchmarks that time kvcached's
own bookkeeping (``hot_path.py``, ``vllm_block_pool.py``, ``memory.py``'s
alloc + free figures): the ledger's cost is not what they measure."""

from __future__ import annotations


class FreeBudget:
    """Every grant succeeds; the headroom (1 PiB) never limits growth."""

    def grant(self, nbytes: int) -> bool:
        return True

    def refund(self, nbytes: int) -> None:
        pass

    def headroom(self) -> int:
        return 1 << 50

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

"""Drive an SGLang token-to-KV allocator the way the scheduler does, and check
what anyone outside it can observe.

The same operation sequence runs against SGLang's native
``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` (the reference)
and, once they exist, kvcached's elastic allocators. Each step asserts:

* every live token index is unique and inside pages ``1 .. size // page_size``
  (page 0 holds SGLang's padding slot 0 and is never handed out; the pool's
  buffers have ``size + page_size`` rows);
* paged allocators keep a request's tokens page-aligned: position ``p`` of a
  request lives at offset ``p % page_size`` of its page, and positions of one
  logical page share one physical page;
* ``available_size()`` equals what the model expects;
* an allocation returns ``None`` exactly when the model says it cannot fit
  (:class:`Driver` with ``budget`` set: when it exceeds the budget), and never
  raises.

The driver is independent of the allocator class; ``budget`` lets a test run a
sequence against an allocator whose capacity is smaller than its ``size``
(the elastic case: misses instead of errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    """One request's KV row: ``tokens[p]`` is the KV slot of position ``p``."""

    rid: int
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Op:
    """One scheduler-like operation. ``kind`` is one of ``new``, ``extend``,
    ``decode``, ``finish``, ``group_free``, ``clear``; ``a`` and ``b`` are
    small integers the kind interprets (see :meth:`Driver.run`)."""

    kind: str
    a: int = 0
    b: int = 0


class Driver:
    """Runs :class:`Op` sequences on one allocator and checks every step."""

    def __init__(self, allocator: Any, *, budget: int | None = None) -> None:
        self.alloc = allocator
        self.device = torch.device(allocator.device)
        self.size = int(allocator.size)
        self.page_size = int(allocator.page_size)
        self.paged = self.page_size > 1
        kvcache = getattr(allocator, "_kvcache", None)
        kv = None
        if kvcache is not None:
            from kvcached.integrations.sglang.pools import elastic_kv_of

            kv = elastic_kv_of(kvcache)
        native_rows = self.page_size * (self.size // self.page_size + 1)
        self.rows = int(kv.rows) if kv is not None else native_rows
        self.budget = budget
        self.requests: dict[int, Request] = {}
        self.next_rid = 0
        self.misses = 0
        self.log: list[tuple[str, Any]] = []

    # -- model ----------------------------------------------------------------
    def used_slots(self) -> int:
        """Slots the model counts as taken (whole pages on a paged allocator)."""
        if not self.paged:
            return sum(len(r.tokens) for r in self.requests.values())
        ps = self.page_size
        return sum(-(-len(r.tokens) // ps) * ps for r in self.requests.values())

    def expected_available(self) -> int:
        """What ``available_size()`` must report: the free slots, and with a
        budget no more than the budget leaves."""
        free = self.size - self.used_slots()
        if self.budget is not None:
            free = min(free, self.budget - self.used_slots())
        return free

    def _fits(self, new_slots: int) -> bool:
        return new_slots <= self.expected_available()

    def _new_pages(self, prefix: int, seq: int) -> int:
        ps = self.page_size
        return -(-seq // ps) - (-(-prefix // ps))

    # -- operations -------------------------------------------------------------
    def run(self, ops: list[Op]) -> None:
        for op in ops:
            getattr(self, f"_op_{op.kind}")(op)
            self.check()

    def _op_new(self, op: Op) -> None:
        """A new request of ``a + 1`` prompt tokens."""
        self._extend([self._new_request()], [op.a + 1], drop_on_miss=True)

    def _op_extend(self, op: Op) -> None:
        """Extend up to ``b + 1`` live requests (from index ``a``) by ``a % 5 + 1``."""
        reqs = self._pick(op.a, op.b + 1)
        if reqs:
            self._extend(reqs, [op.a % 5 + 1] * len(reqs), drop_on_miss=False)

    def _op_decode(self, op: Op) -> None:
        """One decode token for up to ``b + 1`` live requests from index ``a``."""
        reqs = [r for r in self._pick(op.a, op.b + 1) if r.tokens]
        if not reqs:
            return
        if self.paged:
            new_pages = sum(1 for r in reqs if len(r.tokens) % self.page_size == 0)
            fits = self._fits(new_pages * self.page_size)
            seq = torch.tensor([len(r.tokens) + 1 for r in reqs], dtype=torch.int64)
            last = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.int64)
            out = self.alloc.alloc_decode(self._dev(seq), seq, self._dev(last))
        else:
            fits = self._fits(len(reqs))
            out = self.alloc.alloc(len(reqs))
        self._take(reqs, [1] * len(reqs), out, fits)

    def _op_finish(self, op: Op) -> None:
        """Free the request at index ``a``."""
        reqs = self._pick(op.a, 1)
        if reqs:
            req = reqs[0]
            del self.requests[req.rid]
            if req.tokens:
                self.alloc.free(self._dev(torch.tensor(req.tokens, dtype=torch.int64)))

    def _op_group_free(self, op: Op) -> None:
        """Free up to ``b + 1`` requests inside one free group."""
        reqs = self._pick(op.a, op.b + 1)
        self.alloc.free_group_begin()
        for req in reqs:
            del self.requests[req.rid]
            if req.tokens:
                self.alloc.free(self._dev(torch.tensor(req.tokens, dtype=torch.int64)))
        self.alloc.free_group_end()

    def _op_clear(self, op: Op) -> None:
        self.requests.clear()
        self.alloc.clear()

    # -- helpers ------------------------------------------------------------------
    def _dev(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy on the allocator's device (SGLang passes device tensors and
        ``*_cpu`` mirrors side by side)."""
        return tensor.to(self.device, copy=True)

    def _new_request(self) -> Request:
        req = Request(self.next_rid)
        self.next_rid += 1
        self.requests[req.rid] = req
        return req

    def _pick(self, start: int, count: int) -> list[Request]:
        live = list(self.requests.values())
        if not live:
            return []
        start %= len(live)
        return live[start : start + count]

    def _extend(self, reqs: list[Request], lens: list[int], *, drop_on_miss: bool) -> None:
        if self.paged:
            prefix = [len(r.tokens) for r in reqs]
            seq = [p + n for p, n in zip(prefix, lens, strict=True)]
            new_pages = sum(self._new_pages(p, s) for p, s in zip(prefix, seq, strict=True))
            fits = self._fits(new_pages * self.page_size)
            prefix_t = torch.tensor(prefix, dtype=torch.int64)
            seq_t = torch.tensor(seq, dtype=torch.int64)
            last = torch.tensor([r.tokens[-1] if r.tokens else -1 for r in reqs], dtype=torch.int64)
            out = self.alloc.alloc_extend(
                self._dev(prefix_t), prefix_t, self._dev(seq_t), seq_t, self._dev(last), sum(lens)
            )
        else:
            fits = self._fits(sum(lens))
            out = self.alloc.alloc(sum(lens))
        taken = self._take(reqs, lens, out, fits)
        if not taken and drop_on_miss:
            for req in reqs:
                del self.requests[req.rid]

    def _take(self, reqs: list[Request], lens: list[int], out: Any, fits: bool) -> bool:
        if out is None:
            assert not fits, (
                f"allocation of {lens} returned None although the model has room "
                f"(available {self.expected_available()}, budget {self.budget})"
            )
            self.misses += 1
            self.log.append(("miss", lens))
            return False
        assert fits, (
            f"allocation of {lens} succeeded beyond the model's room "
            f"(available {self.expected_available()}, budget {self.budget})"
        )
        values = out.tolist()
        assert len(values) == sum(lens), f"asked {sum(lens)} slots, got {len(values)}"
        pos = 0
        for req, n in zip(reqs, lens, strict=True):
            req.tokens.extend(values[pos : pos + n])
            pos += n
        self.log.append(("alloc", lens))
        return True

    # -- invariants -------------------------------------------------------------
    def check(self) -> None:
        live = [t for r in self.requests.values() for t in r.tokens]
        assert len(live) == len(set(live)), "a KV slot is held by two positions"
        # Pages from 1 (page 0 is the padding page) to the last row of the pool's
        # buffers: size + page_size rows natively; kvcached's pool has every row its
        # virtual tensors hold (ElasticKV.rows, whole kvcached pages), so its block
        # manager may place a page beyond size // page_size while the allocator
        # keeps SGLang's page count as its logical limit (checked by the model's
        # available_size and misses).
        low, high = self.page_size, self.rows - 1
        bad = sorted(t for t in live if not low <= t <= high)
        assert not bad, f"slots outside [{low}, {high}]: {bad}"
        if self.paged:
            ps = self.page_size
            owner_of_page: dict[int, tuple[int, int]] = {}
            page_of_owner: dict[tuple[int, int], int] = {}
            for r in self.requests.values():
                for p, t in enumerate(r.tokens):
                    assert t % ps == p % ps, (
                        f"request {r.rid} position {p} at slot {t}: not page-aligned (page size {ps})"
                    )
                    owner = (r.rid, p // ps)
                    assert owner_of_page.setdefault(t // ps, owner) == owner, (
                        f"physical page {t // ps} shared by {owner_of_page[t // ps]} and {owner}"
                    )
                    assert page_of_owner.setdefault(owner, t // ps) == t // ps, (
                        f"request {r.rid} logical page {p // ps} spread over physical pages "
                        f"{page_of_owner[owner]} and {t // ps}"
                    )
        assert int(self.alloc.available_size()) == self.expected_available(), (
            f"available_size() {self.alloc.available_size()} != model {self.expected_available()}"
        )

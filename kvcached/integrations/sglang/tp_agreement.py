"""One KV budget for every tensor-parallel rank, agreed once per scheduling round.

Under TP each SGLang rank has its own pool on its own GPU, and its free memory
is that GPU's: with another engine on one GPU only, the ranks would read
different counts, admit different batches or evict different amounts, and the
forward would desynchronise. SGLang's scheduler is otherwise deterministic
across ranks (every rank sees the same requests and the same tree), so it is
enough that every read of "how much may I allocate" returns the same number on
every rank. :class:`RoundAgreement` gives that number:

* :meth:`~RoundAgreement.begin_round` (outermost call only) reads the local
  count and MIN-all-reduces it over the attention-TP then attention-CP CPU
  groups: the smallest rank's headroom becomes everyone's budget. It reduces
  whatever the local count is, so every rank issues the same collectives in
  the same order.
* Inside the round :meth:`~RoundAgreement.available` is the agreed count plus
  the round's own tally (minus what the round allocated, plus what it freed),
  never the live count: the live count re-reads physical free memory after
  every allocation and would differ between ranks again.
* :meth:`~RoundAgreement.agree` MAX-reduces one failure flag per allocation
  attempt, so an allocation that fails physically on one rank (the GPU's
  ledger shrank under it mid-round) is a miss on every rank, and every rank
  rolls it back.
* With no group of more than one rank (TP=1, or a pipeline stage that opens no
  round) nothing is reduced and every read is the live local count.

Not thread-safe: it belongs to one scheduler thread, as SGLang's pools do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Reducer(Protocol):
    """An all-reduce of one integer over the ranks that schedule together."""

    @property
    def active(self) -> bool:
        """Whether more than one rank takes part (otherwise nothing is reduced)."""

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""

    def all_reduce_max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""


class GroupReducer:
    """:class:`Reducer` over ``torch.distributed`` CPU (gloo) groups, in order.

    SGLang passes its scheduler's ``attn_tp_cpu_group`` and
    ``attn_cp_cpu_group``: reducing over the attention-TP group and then the
    attention-CP group gives the minimum over the ranks that run one batch
    (the groups form a grid), and never crosses attention-DP replicas, which
    schedule independently. Groups of one rank (or ``None``) are dropped.

    ``device``: where the reduced tensors live, ``cpu`` (default) for gloo
    groups; an NCCL group reduces only CUDA tensors, so pass its rank's device.
    """

    def __init__(self, groups: Sequence[Any], device: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        self._dist = dist
        self._device = torch.device("cpu") if device is None else torch.device(device)
        self._groups = tuple(
            g for g in groups if g is not None and dist.get_world_size(group=g) > 1
        )

    @property
    def active(self) -> bool:
        return bool(self._groups)

    def all_reduce_min(self, value: int) -> int:
        return self._reduce(value, self._dist.ReduceOp.MIN)

    def all_reduce_max(self, value: int) -> int:
        return self._reduce(value, self._dist.ReduceOp.MAX)

    def all_reduce_min_pair(self, first: int, second: int) -> tuple[int, int]:
        """Both values MIN-reduced in one collective (a two-element tensor)."""
        import torch

        tensor = torch.tensor([int(first), int(second)], dtype=torch.int64, device=self._device)
        for group in self._groups:
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN, group=group)
        first_out, second_out = tensor.tolist()
        return int(first_out), int(second_out)

    def _reduce(self, value: int, op: Any) -> int:
        import torch

        tensor = torch.tensor([int(value)], dtype=torch.int64, device=self._device)
        for group in self._groups:
            self._dist.all_reduce(tensor, op=op, group=group)
        return int(tensor.item())


@dataclass
class AgreementStats:
    """Counters a test (or a metrics line) reads."""

    rounds: int = 0
    min_reduces: int = 0
    max_reduces: int = 0
    agreed_misses: int = 0


class RoundAgreement:
    """The agreed KV budget of one scheduler across its TP ranks.

    Invariants:

    * at most one MIN reduce per outermost round, and one MAX reduce per
      :meth:`agree` inside a round; none outside a round or without an active
      reducer;
    * inside a round, :meth:`available` = agreed + frees - allocations of that
      round (floored at 0), identical on every rank that made the same calls;
    * outside a round (or with no active reducer) :meth:`available` is
      ``local_available()``;
    * with ``local_request`` (a count some rank wants acted on this round,
      e.g. prefix-cache tokens to evict for the control thread), the round's
      one collective also MAX-reduces it (packed as ``MIN(-request)``, so it
      stays one collective): :attr:`request` is the same on every rank.
    """

    def __init__(
        self,
        local_available: Callable[[], int],
        reducer: Reducer | None,
        local_request: Callable[[], int] | None = None,
    ) -> None:
        if not callable(local_available):
            raise TypeError(
                f"local_available={local_available!r}: must be a callable returning "
                "this rank's allocatable count"
            )
        self._local_available = local_available
        self._local_request = local_request
        #: The round's agreed request (see the class invariants); 0 outside rounds.
        self.request = 0
        self._reducer = reducer if reducer is not None and reducer.active else None
        self._depth = 0
        self._agreed: int | None = None
        self._tally = 0
        self.stats = AgreementStats()

    def attach(self, reducer: Reducer | None) -> None:
        """Use ``reducer`` from the next round on (SGLang's groups exist only
        once the scheduler does, after the pools were built)."""
        assert self._depth == 0, "attach a reducer between rounds, not inside one"
        self._reducer = reducer if reducer is not None and reducer.active else None

    @property
    def distributed(self) -> bool:
        """Whether rounds reduce over other ranks."""
        return self._reducer is not None

    @property
    def in_round(self) -> bool:
        return self._depth > 0

    def begin_round(self) -> None:
        """Open a round; the outermost one agrees on the budget."""
        self._depth += 1
        if self._depth > 1:
            return
        self.stats.rounds += 1
        self._tally = 0
        request = max(int(self._local_request()), 0) if self._local_request is not None else 0
        if self._reducer is None:
            self._agreed = None
            self.request = request
            return
        local = max(int(self._local_available()), 0)
        self.stats.min_reduces += 1
        if self._local_request is None:
            self._agreed = self._reducer.all_reduce_min(local)
        else:
            self._agreed, negated = self._reducer.all_reduce_min_pair(local, -request)
            self.request = -negated

    def end_round(self) -> None:
        """Close the innermost round; the outermost close forgets the budget."""
        assert self._depth > 0, "end_round without begin_round: rounds must nest"
        self._depth -= 1
        if self._depth == 0:
            self._agreed = None
            self._tally = 0
            self.request = 0

    @contextmanager
    def round(self) -> Iterator[RoundAgreement]:
        """``with agreement.round(): ...`` for one scheduling round."""
        self.begin_round()
        try:
            yield self
        finally:
            self.end_round()

    def available(self) -> int:
        """What the scheduler may allocate now (see the class invariants)."""
        if self._agreed is None:
            return int(self._local_available())
        return max(self._agreed + self._tally, 0)

    def note_alloc(self, count: int) -> None:
        """Record ``count`` units allocated in this round (no-op outside one)."""
        if count < 0:
            raise ValueError(f"count={count}: must be >= 0")
        if self._agreed is not None:
            self._tally -= count

    def note_free(self, count: int) -> None:
        """Record ``count`` units freed in this round (no-op outside one)."""
        if count < 0:
            raise ValueError(f"count={count}: must be >= 0")
        if self._agreed is not None:
            self._tally += count

    def agree(self, ok: bool) -> bool:
        """Whether an allocation attempt succeeded on every rank.

        Inside a distributed round this is one MAX reduce of the failure flag,
        issued on every rank whatever its own outcome. Outside, ``ok`` itself.
        """
        if self._agreed is None:
            return bool(ok)
        self.stats.max_reduces += 1
        assert self._reducer is not None, "a round with an agreed budget has a reducer"
        failed = self._reducer.all_reduce_max(0 if ok else 1)
        if failed:
            self.stats.agreed_misses += 1
        return not failed

"""The limit and elastic cases' steps that both GPU runners share (e2e_cases), on
stand-in servers whose charges a stand-in ``kvctl`` reports (no GPU, no engine):
each check passes where the server behaves and fails where it does not."""

from __future__ import annotations

import pytest

from tests.gpu import e2e_cases

MIB = 1 << 20


class Ledger:
    """The charges ``kvctl`` would list, and the limits ``kvctl limit`` sets."""

    def __init__(self) -> None:
        self.charge: dict[str, int] = {}
        self.limit: dict[str, int | None] = {}

    def kvctl(self, *args: str) -> object:
        if args[0] == "list":
            return [{"name": args[1], "charged_bytes": self.charge[args[1]], "used_bytes": 0}]
        if args[0] == "gpus":
            used = sum(self.charge.values())
            return [{"headroom_bytes": 4000 * MIB - used, "instances": list(self.charge)}]
        if args[0] == "limit":
            self.limit[args[1]] = None if args[2] == "none" else int(args[2])
            if self.limit[args[1]] is not None:
                self.charge[args[1]] = min(self.charge[args[1]], self.limit[args[1]])
            return {"name": args[1]}
        raise AssertionError(f"kvctl {args}: not a command the cases use")


class FakeServer:
    """Each prompt word adds 10,000 bytes to its charge (kept within a limit
    unless ``obeys_limit`` is off); a prefix-cache reset gives back all but the
    idle 100 MiB unless ``releases`` is off."""

    def __init__(self, ledger: Ledger, name: str, obeys_limit: bool = True,
                 releases: bool = True) -> None:  # fmt: skip
        self.ledger, self.name = ledger, name
        self.obeys_limit, self.releases = obeys_limit, releases
        ledger.charge[name] = 100 * MIB

    def complete(self, prompt: str, max_tokens: int) -> dict:
        charge = self.ledger.charge[self.name] + 10_000 * len(prompt.split())
        limit = self.ledger.limit.get(self.name)
        if self.obeys_limit and limit is not None:
            charge = min(charge, limit)
        self.ledger.charge[self.name] = charge
        tokens = [f"t{len(prompt) % 7}"] * max_tokens
        return {"status": 200, "tokens": tokens, "completion_tokens": max_tokens}

    def complete_all(self, prompts: list[str], max_tokens: int, concurrent: bool) -> list[dict]:
        return [self.complete(p, max_tokens) for p in prompts]

    def reset_prefix_cache(self) -> int:
        if self.releases:
            self.ledger.charge[self.name] = 100 * MIB
        return 200

    def alive(self) -> bool:
        return True


@pytest.fixture
def ledger(monkeypatch) -> Ledger:
    ledger = Ledger()
    monkeypatch.setattr(e2e_cases, "kvctl", ledger.kvctl)
    return ledger


def test_limit_steps_pass_on_a_server_that_keeps_the_limit(ledger) -> None:
    rec: dict = {}
    checks: dict = {}
    server = FakeServer(ledger, e2e_cases.LIMIT_NAME)
    e2e_cases.limit_steps(server, "byte-level", rec, checks, fill_count=8, fill_words=400,
                          long_words=300)  # fmt: skip
    assert list(checks) == [
        "fill_ok",
        "idle_usage_within_limit_in_30s",
        "every_request_under_the_limit_ok",
        "usage_stayed_within_limit",
        "refill_ok",
        "regrew_past_the_limit",
        "alive_after_load",
    ]
    assert all(checks.values()), checks
    assert rec["idle"] < rec["limit"] < rec["filled"] < rec["regrown"]
    assert rec["peak_under_limit"] == rec["limit"]


def test_limit_steps_fail_when_the_charge_passes_the_limit(ledger) -> None:
    rec: dict = {}
    checks: dict = {}
    server = FakeServer(ledger, e2e_cases.LIMIT_NAME, obeys_limit=False)
    e2e_cases.limit_steps(server, "byte-level", rec, checks, fill_count=8, fill_words=400,
                          long_words=300)  # fmt: skip
    assert checks["usage_stayed_within_limit"] is False
    assert rec["peak_under_limit"] > rec["limit"]


@pytest.mark.parametrize("releases", [True, False])
def test_elastic_steps_check_the_release_after_a_reset(ledger, releases) -> None:
    servers = {"a": FakeServer(ledger, "ea", releases=releases), "b": FakeServer(ledger, "eb")}
    rec: dict = {}
    checks: dict = {}
    e2e_cases.elastic_steps(servers, "byte-level", rec, checks, words=300, flush_s=0)
    assert checks.pop("a_reset_releases_over_half_of_its_growth") is releases
    assert all(checks.values()), checks
    assert rec["a_peak"] - rec["a_idle"] > rec["free_start"] / 2
    assert rec["b_peak"] > rec["free_at_a_peak"]


def test_servers_ready_raises_when_one_did_not_start() -> None:
    class Ready:
        def __init__(self, s: float | None) -> None:
            self.s = s

        def wait_ready(self, timeout: float) -> float | None:
            return self.s

    rec: dict = {}
    checks: dict = {}
    with pytest.raises(RuntimeError, match="did not start"):
        e2e_cases.servers_ready({"a": Ready(1.0), "b": Ready(None)}, 5, rec, checks)
    assert rec["ready_s"] == {"a": 1.0, "b": None} and checks == {"servers_ready": False}

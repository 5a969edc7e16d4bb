"""Round loop + checkpoints without Flower: a crash mid-run resumes to the same model."""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.aggregation import get_rule
from cloud_coordinator.loop import RoundFailed, run_rounds
from cloud_coordinator.rounds import Reply, RunConfig, Wait, client_seed, config_hash, wait_decision
from cloud_coordinator.selection import Selection
from cloud_coordinator.store import CheckpointStore


class Crash(Exception):
    pass


class FakeFleet:
    """Clients pull the model towards their own target, with seeded noise; one may be Byzantine."""

    def __init__(self, n: int = 4, byzantine: str = "", crash_in_round: int | None = None,
                 drop: frozenset[str] = frozenset()) -> None:
        self.targets = {f"dev-{i}": np.full(5, float(i)) for i in range(n)}
        self.node_of = {d: 1000 + i for i, d in enumerate(self.targets)}
        self.byzantine = byzantine
        self.crash_in_round = crash_in_round
        self.drop = drop
        self.calls: list[int] = []

    def nodes(self, min_nodes: int, timeout_s: float) -> dict[int, str]:
        return {n: d for d, n in self.node_of.items()}

    def identify(self, nodes: dict[int, str], timeout_s: float) -> dict[int, str]:
        return nodes

    def train(self, server_round: int, weights: Sequence[np.ndarray], configs: Mapping[int, dict[str, Any]],
              cfg: RunConfig) -> tuple[list[Reply], dict[int, str]]:
        self.calls.append(server_round)
        if server_round == self.crash_in_round:
            raise Crash(f"killed in round {server_round}")
        out = []
        # arrival order deliberately reversed: aggregation must not depend on it
        for node in sorted(configs, reverse=True):
            dev = next(d for d, n in self.node_of.items() if n == node)
            if dev in self.drop:
                continue
            assert configs[node]["client-seed"] == client_seed(cfg.seed, server_round, dev)
            rng = np.random.default_rng(configs[node]["client-seed"])
            w = weights[0] + cfg.lr * (self.targets[dev] - weights[0]) + rng.normal(0, 0.01, 5)
            if dev == self.byzantine:
                w = weights[0] - 100.0 * (w - weights[0])
            out.append(Reply(dev, node, (w,), 10**9 if dev == self.byzantine else 10, {}))
        return out, {}


class FakeModel:
    def initial_weights(self, cfg: RunConfig) -> tuple[np.ndarray, ...]:
        return (np.zeros(5),)

    def evaluate(self, weights: Sequence[np.ndarray], cfg: RunConfig) -> dict[str, float]:
        return {"loss": float(np.sum((weights[0] - 1.5) ** 2))}


def _clock() -> Any:
    c = itertools.count()
    return lambda: float(next(c))


CFG = RunConfig(rounds=5, rule="trimmed_mean", f=1, seed=3, min_clients=3, lr=0.5)


def _run(tmp: Path, fleet: FakeFleet, cfg: RunConfig = CFG, **kw: Any):  # type: ignore[no-untyped-def]
    store = CheckpointStore([tmp / "a", tmp / "b"])
    return run_rounds(cfg, fleet, FakeModel(), store, get_rule(cfg.rule, cfg.f, seed=cfg.seed), _clock(), **kw)


@pytest.mark.parametrize("rule", ["trimmed_mean", "nnm+centered_clipping", "nnm+trimmed_mean", "multi_krum"])
def test_crash_and_resume_equals_uninterrupted(tmp_path: Path, rule: str) -> None:
    cfg = RunConfig(rounds=5, rule=rule, f=1, seed=3, min_clients=3, lr=0.5)
    ref = _run(tmp_path / "ref", FakeFleet(n=5, byzantine="dev-3"), cfg)
    with pytest.raises(Crash):
        _run(tmp_path / "run", FakeFleet(n=5, byzantine="dev-3", crash_in_round=3), cfg)
    fleet = FakeFleet(n=5, byzantine="dev-3")
    got = _run(tmp_path / "run", fleet, cfg)
    assert got.resumed_from == 2 and fleet.calls == [3, 4, 5]  # only the in-flight round repeats
    np.testing.assert_allclose(got.weights[0], ref.weights[0], rtol=0, atol=1e-12)
    assert [h["round"] for h in got.history] == [1, 2, 3, 4, 5]


def test_robust_rule_ignores_inflated_example_counts(tmp_path: Path) -> None:
    rep = _run(tmp_path, FakeFleet(byzantine="dev-3"))
    assert np.all(np.abs(rep.weights[0] - 1.0) < 1.0)  # honest targets 0,1,2
    krum = _run(tmp_path / "k", FakeFleet(n=5, byzantine="dev-3"), RunConfig(rounds=2, rule="krum", f=1, seed=3,
                                                                        min_clients=3, lr=0.5))
    assert all("dev-3" in h["rejected"] for h in krum.history)
    mean = _run(tmp_path / "m", FakeFleet(byzantine="dev-3"), RunConfig(rounds=2, rule="mean", f=0, seed=3,
                                                                        min_clients=3, lr=0.5))
    assert np.all(mean.weights[0] < -10)  # FedAvg by reported counts is captured by the liar


def test_finished_run_resumes_to_nothing(tmp_path: Path) -> None:
    _run(tmp_path, FakeFleet())
    fleet = FakeFleet()
    again = _run(tmp_path, fleet)
    assert fleet.calls == [] and again.resumed_from == 5


def test_quorum_round_and_failure(tmp_path: Path) -> None:
    rep = _run(tmp_path, FakeFleet(drop=frozenset({"dev-0"})))
    assert rep.history[0]["clients"] == ["dev-1", "dev-2", "dev-3"]
    with pytest.raises(RoundFailed):
        _run(tmp_path / "x", FakeFleet(drop=frozenset({"dev-0", "dev-1"})))


def test_selection_excludes_devices(tmp_path: Path) -> None:
    def select(rnd: int, nodes: dict[int, str]) -> Selection:
        return Selection(("dev-1", "dev-2", "dev-3"), {"dev-0": "battery below floor", "dev-1": "selected",
                                                       "dev-2": "selected", "dev-3": "selected"})
    rep = _run(tmp_path, FakeFleet(), select=select)
    assert rep.history[0]["clients"] == ["dev-1", "dev-2", "dev-3"]
    assert rep.history[0]["not_selected"] == {"dev-0": "battery below floor"}


def test_other_config_starts_fresh(tmp_path: Path) -> None:
    _run(tmp_path, FakeFleet())
    other = RunConfig(rounds=5, rule="trimmed_mean", f=1, seed=4, min_clients=3, lr=0.5)
    assert config_hash(other) != config_hash(CFG)
    assert _run(tmp_path, FakeFleet(), other).resumed_from == 0


@pytest.mark.parametrize("args, want", [
    ((3, 3, 3, 2, 1.0, None, 10, 2), Wait.ALL),
    ((3, 2, 2, 2, 1.0, 0.5, 10, 2), Wait.WAIT),
    ((3, 2, 2, 2, 3.0, 2.5, 10, 2), Wait.QUORUM),
    ((3, 2, 1, 2, 11.0, None, 10, 2), Wait.TIMEOUT),
    ((3, 1, 1, 2, 5.0, None, 10, 2), Wait.WAIT),
])
def test_wait_decision(args: tuple, want: Wait) -> None:  # type: ignore[type-arg]
    assert wait_decision(*args) is want


def test_client_seed_stable() -> None:
    assert client_seed(1, 2, "a") == client_seed(1, 2, "a") != client_seed(1, 3, "a")
    assert 0 <= client_seed(0, 0, "") < 2**31

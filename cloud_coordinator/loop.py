"""The coordinator's round loop, written against two seams: a ``Fleet`` and a ``ModelOps``.

The Flower ServerApp supplies a ``Fleet`` over the Grid (``flower_server``);
tests supply an in-process one. The loop resumes from the newest verified
checkpoint, runs the remaining rounds, aggregates with a robust rule in
device-id order, evaluates centrally and checkpoints per the policy. Clock and
logging come in as parameters, so a test can drive it without Flower.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from runtime.errors import FoglineError

from .policy import rounds_between_checkpoints, should_checkpoint
from .rounds import WEIGHTED_RULES, Reply, RunConfig, client_seed, config_hash, flatten, ordered, unflatten
from .selection import Selection
from .store import Checkpoint, CheckpointStore

__all__ = ["Fleet", "ModelOps", "RoundFailed", "RunReport", "run_rounds", "MAX_ATTEMPTS"]

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3


class RoundFailed(FoglineError):
    """A round could not gather ``min_clients`` replies within its attempts."""


class Fleet(Protocol):
    def nodes(self, min_nodes: int, timeout_s: float) -> dict[int, str]:
        """Connected node id -> device id ("" if not yet known); waits (bounded) for ``min_nodes``."""
        ...

    def identify(self, nodes: dict[int, str], timeout_s: float) -> dict[int, str]:
        """Fill in unknown device ids (a query round); nodes that do not answer keep ""."""
        ...

    def train(self, server_round: int, weights: Sequence[np.ndarray], configs: Mapping[int, dict[str, Any]],
              cfg: RunConfig) -> tuple[list[Reply], dict[int, str]]:
        """Send one training round to the nodes in ``configs``; replies and per-node failures."""
        ...


class ModelOps(Protocol):
    def initial_weights(self, cfg: RunConfig) -> tuple[np.ndarray, ...]: ...

    def evaluate(self, weights: Sequence[np.ndarray], cfg: RunConfig) -> dict[str, float]: ...


@dataclass(slots=True)
class RunReport:
    config_hash: str
    resumed_from: int
    rounds_done: int
    weights: tuple[np.ndarray, ...]
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped_checkpoints: list[str] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)
    resume_s: float = 0.0


def run_rounds(cfg: RunConfig, fleet: Fleet, model: ModelOps, store: CheckpointStore, aggregator: Any,
               clock: Callable[[], float], *,
               select: Callable[[int, dict[int, str]], Selection | None] | None = None,
               after_round: Callable[[int, tuple[np.ndarray, ...], dict[str, Any]], None] | None = None,
               ) -> RunReport:
    """Run (or finish) ``cfg.rounds`` rounds; returns what happened, the final weights included."""
    chash = config_hash(cfg)
    t0 = clock()
    ckpt, scan = store.load_latest(chash)
    report = RunReport(chash, 0, 0, (), skipped_checkpoints=[
        f"replica {e.replica} round {e.server_round}: {e.reason}" for e in scan.skipped])
    for line in report.skipped_checkpoints:
        log.warning("skipped checkpoint %s", line)
    restarts, elapsed = 0, 0.0
    if ckpt is not None:
        weights = tuple(np.array(w) for w in ckpt.weights)
        aggregator.load_state_dict(ckpt.aggregator_state)
        history = list(ckpt.history)
        start = ckpt.server_round + 1
        restarts = int(ckpt.extra.get("restarts", 0)) + (1 if start <= cfg.rounds else 0)
        elapsed = float(ckpt.extra.get("elapsed_s", 0.0))
        report.resumed_from = ckpt.server_round
        log.info("resuming after round %d (config %s)", ckpt.server_round, chash)
    else:
        weights = tuple(model.initial_weights(cfg))
        history, start = [], 1
    report.resume_s = clock() - t0
    last_ckpt = start - 1
    for rnd in range(start, cfg.rounds + 1):
        r0 = clock()
        weights, entry = _one_round(rnd, cfg, fleet, model, aggregator, weights, select)
        history.append(entry)
        report.round_s.append(clock() - r0)
        elapsed += report.round_s[-1]
        every = rounds_between_checkpoints(store.policy, float(np.mean(report.round_s)),
                                           float(np.mean(report.checkpoint_s)) if report.checkpoint_s else None,
                                           restarts, elapsed)
        if should_checkpoint(rnd, last_ckpt, cfg.rounds, every):
            saved = store.save(Checkpoint(rnd, weights, chash, aggregator.state_dict(),
                                          {"seed": cfg.seed, "next_round": rnd + 1}, tuple(history),
                                          {"restarts": restarts, "elapsed_s": elapsed}))
            report.checkpoint_s.append(saved.seconds)
            last_ckpt = rnd
        log.info("round %d: %s", rnd, {k: v for k, v in entry.items() if k != "rejected"})
        if after_round is not None:
            after_round(rnd, weights, entry)
    report.rounds_done = cfg.rounds
    report.weights = weights
    report.history = history
    return report


def _one_round(rnd: int, cfg: RunConfig, fleet: Fleet, model: ModelOps, aggregator: Any,
               weights: tuple[np.ndarray, ...],
               select: Callable[[int, dict[int, str]], Selection | None] | None,
               ) -> tuple[tuple[np.ndarray, ...], dict[str, Any]]:
    failures: dict[int, str] = {}
    for attempt in range(1, MAX_ATTEMPTS + 1):
        nodes = fleet.nodes(cfg.min_clients, cfg.round_timeout_s)
        reasons: dict[str, str] = {}
        chosen = nodes
        if select is not None:
            if any(not d for d in nodes.values()):
                nodes = fleet.identify(nodes, cfg.round_timeout_s)
            sel = select(rnd, nodes)
            if sel is not None:  # None: no fleet information, everyone connected trains
                reasons = {d: why for d, why in sel.reasons.items() if why != "selected"}
                chosen = {n: d for n, d in nodes.items() if d in set(sel.selected) or n in sel.nodes}
        configs = {n: {"server-round": rnd, "global-seed": cfg.seed, "attempt": attempt,
                       **({"client-seed": client_seed(cfg.seed, rnd, d)} if d else {})}
                   for n, d in sorted(chosen.items())}
        if len(configs) < cfg.min_clients:
            failures = {n: "not selected" for n in nodes}
            log.warning("round %d attempt %d: %d of %d clients eligible", rnd, attempt, len(configs),
                        cfg.min_clients)
            continue
        replies, failures = fleet.train(rnd, weights, configs, cfg)
        if len(replies) >= cfg.min_clients:
            break
        log.warning("round %d attempt %d: %d replies < min_clients %d (%s)", rnd, attempt, len(replies),
                    cfg.min_clients, failures)
    else:
        raise RoundFailed(f"round {rnd}: fewer than {cfg.min_clients} replies after {MAX_ATTEMPTS} attempts: "
                          f"{failures}")
    replies = ordered(replies)
    g = flatten(weights)
    updates = np.stack([flatten(r.weights) - g for r in replies])
    w = np.array([max(r.num_examples, 0) for r in replies], dtype=np.float64) \
        if cfg.rule in WEIGHTED_RULES else None
    res = aggregator.aggregate(updates, w)
    new = unflatten(g + np.asarray(res.update, dtype=np.float64), weights)
    metrics = model.evaluate(new, cfg)
    ids = [r.device_id for r in replies]
    entry: dict[str, Any] = {
        "round": rnd, "clients": ids, "selected": [ids[i] for i in res.selected],
        "rejected": {ids[i]: why for i, why in dict(res.rejected).items()},
        "failed": {str(k): v for k, v in failures.items()}, "not_selected": reasons,
        "attempt": attempt, **{k: float(v) for k, v in metrics.items()},
    }
    return new, entry

"""When to checkpoint, what to keep, what to resume from: pure decisions over plain data.

No clock and no file system here: the shell passes measured round times,
observed failures and the manifests it found, and acts on the answers.

Checkpoint interval (first-order, Young 1974)::

    tau_opt = sqrt(2 * C * MTBF)

where ``C`` is the time to write one checkpoint and ``MTBF`` the mean time
between failures. Daly (2006) refines it for the case where C is not small
against MTBF (``R`` the restart time does not change the optimum)::

    tau_opt = sqrt(2*C*M) * (1 + sqrt(C/(2*M))/3 + C/(18*M)) - C    if C < 2*M
    tau_opt = M                                                     otherwise

A federated round is the natural unit of work, so the interval in seconds
is turned into "checkpoint every k rounds" with k = max(1, floor(tau / round_time)).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.errors import LocalViolation

__all__ = [
    "young_interval", "daly_interval", "FailureEstimate", "estimate_mtbf",
    "CheckpointPolicy", "rounds_between_checkpoints", "should_checkpoint",
    "ReplicaEntry", "choose_resume", "to_prune",
]


def young_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: tau = sqrt(2 * C * MTBF)."""
    _check_positive(checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum; equals ``mtbf_s`` once C >= 2 * MTBF."""
    _check_positive(checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s)
    c, m = checkpoint_cost_s, mtbf_s
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0 or math.isinf(v):  # also rejects NaN
            raise LocalViolation(f"{name} must be finite and > 0, got {v}")


@dataclass(frozen=True, slots=True)
class FailureEstimate:
    """Observed failures over an observed span; MTBF = span / failures (None if no failure yet)."""

    failures: int
    observed_s: float

    @property
    def mtbf_s(self) -> float | None:
        return self.observed_s / self.failures if self.failures > 0 and self.observed_s > 0 else None


def estimate_mtbf(failures: int, observed_s: float, prior_mtbf_s: float) -> float:
    """MTBF with a prior of one failure per ``prior_mtbf_s``, so zero failures is not infinity."""
    _check_positive(prior_mtbf_s=prior_mtbf_s)
    return (max(observed_s, 0.0) + prior_mtbf_s) / (max(failures, 0) + 1)


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """How often and how durably to checkpoint.

    ``mode`` "every-round" checkpoints after each round; "young" and "daly"
    derive the interval from measured cost and MTBF. ``keep`` is K, the
    checkpoints retained per replica; ``quorum`` the replicas a write needs and
    a resume must find a round verified in (None: a majority of the replicas).
    """

    mode: str = "every-round"
    keep: int = 3
    quorum: int | None = None
    prior_mtbf_s: float = 3600.0
    max_rounds_between: int = 50

    def __post_init__(self) -> None:
        if self.mode not in ("every-round", "young", "daly"):
            raise LocalViolation(f"unknown checkpoint mode {self.mode!r}")
        if self.keep < 1 or (self.quorum is not None and self.quorum < 1) or self.max_rounds_between < 1:
            raise LocalViolation("keep, quorum and max_rounds_between must be >= 1")

    def quorum_for(self, replicas: int) -> int:
        """The quorum over ``replicas`` directories; more than there are is an error, never a silent 1."""
        q = replicas // 2 + 1 if self.quorum is None else self.quorum
        if q > replicas:
            raise LocalViolation(f"checkpoint quorum {q} is larger than the {replicas} replica "
                                 f"director{'y' if replicas == 1 else 'ies'}; add replicas or lower the quorum")
        return q


def rounds_between_checkpoints(policy: CheckpointPolicy, round_time_s: float | None,
                               checkpoint_cost_s: float | None, failures: int,
                               observed_s: float) -> int:
    """k such that checkpointing every k rounds approximates tau_opt (1 until measured)."""
    if policy.mode == "every-round" or not round_time_s or not checkpoint_cost_s:
        return 1
    mtbf = estimate_mtbf(failures, observed_s, policy.prior_mtbf_s)
    fn = young_interval if policy.mode == "young" else daly_interval
    tau = fn(checkpoint_cost_s, mtbf)
    return max(1, min(policy.max_rounds_between, int(tau // round_time_s)))


def should_checkpoint(server_round: int, last_checkpointed: int, total_rounds: int, every: int) -> bool:
    """Checkpoint when ``every`` rounds passed since the last one, and always after the final round."""
    return server_round >= total_rounds or server_round - last_checkpointed >= every


# ---------------------------------------------------------------- replicas


@dataclass(frozen=True, slots=True)
class ReplicaEntry:
    """One checkpoint found in one replica, with the verdict of its checksum."""

    replica: int
    server_round: int
    config_hash: str
    ok: bool
    reason: str = ""
    sha256: str = ""


def choose_resume(entries: Iterable[ReplicaEntry], config_hash: str | None = None,
                  quorum: int = 1) -> ReplicaEntry | None:
    """Newest round verified, with the same payload, in at least ``quorum`` replicas.

    Returns that round's entry in its lowest-numbered replica. A checkpoint written
    under another configuration (different seed, rule, data split) is not resumed
    from: mixing them breaks reproducibility. A round found (or forged) in fewer
    replicas than the quorum does not count, however new it is.
    """
    votes: dict[tuple[int, str, str], list[ReplicaEntry]] = {}
    for e in entries:
        if not e.ok or (config_hash is not None and e.config_hash != config_hash):
            continue
        votes.setdefault((e.server_round, e.sha256, e.config_hash), []).append(e)
    best: ReplicaEntry | None = None
    for group in votes.values():
        if len({e.replica for e in group}) < quorum:
            continue
        first = min(group, key=lambda e: e.replica)
        if best is None or (first.server_round, -first.replica) > (best.server_round, -best.replica):
            best = first
    return best


def to_prune(rounds: Sequence[int], keep: int) -> list[int]:
    """Rounds to delete from one replica so that the newest ``keep`` remain."""
    if keep < 1:
        raise LocalViolation("keep must be >= 1")
    return sorted(set(rounds))[:-keep] if len(set(rounds)) > keep else []

"""Round bookkeeping, pure: run configuration, per-client seeds, quorum waits, reply order.

Determinism is the point: a round repeated after a crash must reproduce the
same global model, so every random choice of a round derives from
(global seed, round, device id) and replies are aggregated in device-id order,
never in arrival order.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np

from runtime.errors import LocalViolation

__all__ = ["RunConfig", "client_seed", "config_hash", "Wait", "wait_decision", "Reply",
           "ordered", "flatten", "unflatten", "WEIGHTED_RULES"]

# Rules for which a client's reported example count may weigh its update. Robust
# rules ignore it: a Byzantine client would simply report a huge count.
WEIGHTED_RULES = frozenset({"mean"})


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything that determines the trained model (hashed into every checkpoint)."""

    rounds: int = 3
    rule: str = "trimmed_mean"
    f: int = 1
    seed: int = 0
    min_clients: int = 2
    num_partitions: int = 3
    model: str = "softmax"
    local_epochs: int = 1
    lr: float = 0.1
    batch_size: int = 32
    iid: bool = True
    alpha: float = 0.5
    round_timeout_s: float = 60.0
    grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.min_clients < 1 or self.f < 0 or self.num_partitions < 1:
            raise LocalViolation("rounds, min_clients, num_partitions >= 1 and f >= 0 required")
        if not self.round_timeout_s > 0:
            raise LocalViolation("round_timeout_s must be > 0")

    def identity(self) -> dict[str, Any]:
        """The fields that change the result (timeouts and quorum do not, if all reply)."""
        d = asdict(self)
        for k in ("rounds", "round_timeout_s", "grace_s", "min_clients"):
            d.pop(k)
        return d

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "RunConfig":
        """From a Flower run config (kebab-case keys); unknown keys are ignored."""
        kw: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            key = name.replace("_", "-")
            if key in m:
                typ = {"int": int, "float": float, "bool": bool, "str": str}[str(f.type)]
                kw[name] = typ(m[key])
        return cls(**kw)

    def to_mapping(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}


def config_hash(cfg: RunConfig) -> str:
    """Short stable hash of what determines the result; resume refuses other hashes."""
    blob = json.dumps(cfg.identity(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def client_seed(global_seed: int, server_round: int, device_id: str) -> int:
    """A 31-bit seed for one client's local training in one round (stable across restarts)."""
    digest = hashlib.sha256(f"fogline/{global_seed}/{server_round}/{device_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Wait(Enum):
    WAIT = "wait"          # keep polling
    ALL = "all replied"
    QUORUM = "quorum after grace"
    TIMEOUT = "timeout"    # deadline passed; caller checks whether min_clients replied


def wait_decision(sent: int, answered: int, ok: int, min_replies: int, elapsed_s: float,
                  since_quorum_s: float | None, timeout_s: float, grace_s: float) -> Wait:
    """Whether to stop waiting for replies.

    Unlike Flower's strategies (which wait for ``min_available_nodes`` forever)
    a round ends when everyone replied, when a quorum replied and the grace
    period for stragglers passed, or at the deadline.
    ``answered`` counts every reply (errors too), ``ok`` the usable ones.
    """
    if answered >= sent:
        return Wait.ALL
    if ok >= min_replies and since_quorum_s is not None and since_quorum_s >= grace_s:
        return Wait.QUORUM
    if elapsed_s >= timeout_s:
        return Wait.TIMEOUT
    return Wait.WAIT


@dataclass(frozen=True, slots=True, eq=False)
class Reply:
    """One client's training result, already unwrapped from the transport."""

    device_id: str
    node_id: int
    weights: tuple[np.ndarray, ...]
    num_examples: int
    metrics: Mapping[str, float]


def ordered(replies: Iterable[Reply]) -> list[Reply]:
    """Replies in device-id order (then node id), so aggregation ignores arrival order."""
    return sorted(replies, key=lambda r: (r.device_id, r.node_id))


def flatten(weights: Iterable[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights])


def unflatten(vec: np.ndarray, like: Iterable[np.ndarray]) -> tuple[np.ndarray, ...]:
    out, i = [], 0
    for w in like:
        n = int(np.prod(w.shape))
        out.append(vec[i:i + n].reshape(w.shape).astype(w.dtype))
        i += n
    if i != vec.size:
        raise LocalViolation(f"vector of {vec.size} does not fit weights of {i}")
    return tuple(out)

"""``RobustStrategy``'s checkpoint collaborator: where a run's rounds are kept, how it resumes, when it saves.

The store (``store.CheckpointStore``: signed, quorum-replicated) and the policy (``policy``: every round,
Young or Daly) do the work; this is the strategy's side of them, so the strategy itself stays a Flower
strategy: the newest round verified in a quorum of replicas to resume from (arrays, the aggregator's
state, the history and restarts), and a checkpoint after each round the policy asks for.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result

from runtime.errors import LocalViolation
from runtime.security import Identity

from .aggregation import Aggregator
from .layout import Layout
from .policy import CheckpointPolicy, rounds_between_checkpoints, should_checkpoint
from .store import Checkpoint, CheckpointStore

__all__ = ["CHECKPOINT_KEY", "CheckpointConfig", "Checkpoints", "Resumed", "signing_identity", "restore_metrics"]

log = logging.getLogger("fogline.strategy")
CHECKPOINT_KEY = "checkpoint.key"  # default signing key, beside the first checkpoint directory (key_path)


def signing_identity(key: Identity | str | Path | None, default: Path) -> Identity:
    """The identity that signs checkpoints and releases: given, loaded from a path, or made at ``default``."""
    if isinstance(key, Identity):
        return key
    if key is None:
        return Identity.load_or_create("coordinator", default)
    return Identity.load("coordinator", key)


@dataclass(slots=True)
class Resumed:
    """Where a run starts: round 1 with the initial arrays, or after the newest verified checkpoint."""

    arrays: ArrayRecord
    history: list[dict[str, Any]] = field(default_factory=list)
    start_round: int = 1
    restarts: int = 0
    resumed_from: int = 0
    skipped: list[str] = field(default_factory=list)  # replicas' checkpoints that did not verify, and why
    seconds: float = 0.0


def restore_metrics(result: Result, history: Iterable[Mapping[str, Any]]) -> None:
    """Flower's ``Result`` of the rounds a resumed run already did (from their checkpointed history)."""
    for h in history:
        rnd = int(h["round"])
        for key, target in (("train", result.train_metrics_clientapp),
                            ("evaluate", result.evaluate_metrics_clientapp),
                            ("server", result.evaluate_metrics_serverapp)):
            if isinstance(h.get(key), dict):
                target[rnd] = MetricRecord({k: v for k, v in h[key].items() if isinstance(v, (int, float))})


def arrays_from(ckpt: Checkpoint, layout: Layout) -> ArrayRecord:
    names = ckpt.names or layout.names
    if tuple(names) != layout.names:
        raise LocalViolation("checkpoint arrays do not match the model layout")
    return ArrayRecord({n: Array(np.asarray(w).astype(np.dtype(dt), order="C"))
                        for n, w, dt in zip(names, ckpt.weights, layout.dtypes)})


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how durably ``RobustStrategy`` checkpoints (``policy.CheckpointPolicy``'s mode,
    keep and quorum); no ``dirs``: no checkpoints. ``signing_key`` signs checkpoints and releases
    (None: one kept beside the first directory, or the work directory)."""

    dirs: tuple[Path, ...] = ()
    mode: str = "every-round"
    keep: int = 3
    quorum: int | None = None
    signing_key: Identity | str | Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dirs", tuple(Path(d) for d in self.dirs))


class Checkpoints:
    """One run's checkpoints: resume once, then ``after_round`` for every round done."""

    def __init__(self, dirs: Sequence[Path], identity: Identity, *, mode: str = "every-round", keep: int = 3,
                 quorum: int | None = None) -> None:
        self.store = CheckpointStore(dirs, CheckpointPolicy(mode=mode, keep=keep, quorum=quorum), identity=identity)
        if len(dirs) == 1:
            log.warning("checkpoints in one directory: no replica guards against a lost or forged file")
        self.seconds: list[float] = []  # what each save took (the Young/Daly interval uses it)
        self.last = 0                   # the newest round checkpointed (or resumed from)

    def resume(self, chash: str, layout: Layout, initial: ArrayRecord, aggregator: Aggregator,
               num_rounds: int) -> Resumed:
        """The newest checkpoint of this configuration verified in a quorum of replicas, or a fresh start."""
        t0 = time.monotonic()
        ckpt, scan = self.store.load_latest(chash)
        out = Resumed(initial, skipped=[f"replica {e.replica} round {e.server_round}: {e.reason}"
                                        for e in scan.skipped])
        for line in out.skipped:
            log.warning("skipped checkpoint %s", line)
        if ckpt is not None:
            out.arrays = arrays_from(ckpt, layout)
            aggregator.load_state_dict(ckpt.aggregator_state)
            out.history = [dict(h) for h in ckpt.history]
            out.start_round = ckpt.server_round + 1
            out.restarts = int(ckpt.extra.get("restarts", 0)) + (1 if out.start_round <= num_rounds else 0)
            out.resumed_from = ckpt.server_round
            log.info("resuming after round %d (config %s)", ckpt.server_round, chash)
        out.seconds = time.monotonic() - t0
        self.last = out.start_round - 1
        return out

    def after_round(self, rnd: int, num_rounds: int, arrays: ArrayRecord, chash: str, aggregator: Aggregator,
                    seed: int, history: Sequence[Mapping[str, Any]], restarts: int, round_s: Sequence[float]) -> None:
        """Checkpoint round ``rnd`` if the policy says so (``store.QuorumError``: too few replicas took it)."""
        every = rounds_between_checkpoints(self.store.policy, float(np.mean(round_s)),
                                           float(np.mean(self.seconds)) if self.seconds else None, restarts,
                                           float(sum(round_s)))
        if not should_checkpoint(rnd, self.last, num_rounds, every):
            return
        layout = Layout.of(arrays)
        weights = tuple(layout.split(layout.flat(arrays)))
        ckpt = Checkpoint(rnd, weights, chash, aggregator.state_dict(), {"seed": seed},
                          tuple(json.loads(json.dumps(h, default=float)) for h in history),
                          {"restarts": restarts, "elapsed_s": float(sum(round_s))}, layout.names)
        saved = self.store.save(ckpt)
        self.seconds.append(saved.seconds)
        self.last = rnd

"""Flower ServerApp (Message API): the thin adapter between the Grid and ``loop.run_rounds``.

Our own round loop instead of a Flower strategy because strategies wait
forever for ``min_available_nodes`` and weigh updates by client-reported
example counts. Here a round pushes Messages, polls replies with a bounded
wait and a quorum (``rounds.wait_decision``), and the loop aggregates with a
robust rule. The run config carries everything (see ``launcher.run_config``).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from runtime import codec
from runtime.errors import DecodeError, FoglineError
from runtime.messages import FleetSummary

from .policy import CheckpointPolicy
from .rounds import Reply, RunConfig, Wait, wait_decision
from .selection import Selection, SelectionPolicy, explain, select_clients
from .store import REPORT_FILE, CheckpointStore, atomic_write

__all__ = ["app", "GridFleet", "REPORT_FILE", "LOCK_FILE"]

log = logging.getLogger("fogline.coordinator")
LOCK_FILE = ".coordinator.lock"
POLL_S = 0.5

app = ServerApp()


class GridFleet:
    """``loop.Fleet`` over a Flower Grid: push, then poll with a deadline and a quorum."""

    def __init__(self, grid: Grid, poll_s: float = POLL_S, extra_config: Mapping[str, Any] | None = None) -> None:
        self.grid = grid
        self.poll_s = poll_s
        self.extra_config = dict(extra_config or {})
        self.device_of: dict[int, str] = {}

    def identify(self, nodes: dict[int, str], timeout_s: float) -> dict[int, str]:
        unknown = [n for n, d in nodes.items() if not d]
        msgs = [Message(RecordDict({"config": ConfigRecord({"what": "identity"})}), dst_node_id=n,
                        message_type="query", ttl=timeout_s + 30.0) for n in unknown]
        for msg in self.grid.send_and_receive(msgs, timeout=timeout_s):
            if not msg.has_error() and "info" in msg.content.config_records:
                self.device_of[msg.metadata.src_node_id] = str(msg.content["info"].get("device-id", ""))
        return {n: self.device_of.get(n, "") for n in nodes}

    def nodes(self, min_nodes: int, timeout_s: float) -> dict[int, str]:
        deadline = time.monotonic() + timeout_s
        ids = sorted(self.grid.get_node_ids())
        while len(ids) < min_nodes and time.monotonic() < deadline:
            time.sleep(self.poll_s)
            ids = sorted(self.grid.get_node_ids())
        return {n: self.device_of.get(n, "") for n in ids}

    def train(self, server_round: int, weights: Sequence[np.ndarray], configs: Mapping[int, dict[str, Any]],
              cfg: RunConfig) -> tuple[list[Reply], dict[int, str]]:
        base = {k: v for k, v in {**cfg.to_mapping(), **self.extra_config}.items()
                if isinstance(v, (int, float, str, bool))}
        arrays = ArrayRecord([np.asarray(w) for w in weights])
        msgs = [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({**base, **extra})}),
                        dst_node_id=node, message_type="train", group_id=str(server_round),
                        ttl=cfg.round_timeout_s + 30.0)
                for node, extra in configs.items()]
        pending = {mid: m.metadata.dst_node_id for mid, m in zip(self.grid.push_messages(msgs), msgs)}
        sent = len(pending)
        t0 = time.monotonic()
        quorum_at: float | None = None
        replies: list[Reply] = []
        failures: dict[int, str] = {}
        shapes = [np.shape(w) for w in weights]
        while True:
            for msg in self.grid.pull_messages(list(pending)):
                node = pending.pop(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
                reply = self._unwrap(node, msg, shapes)
                if isinstance(reply, str):
                    failures[node] = reply
                else:
                    replies.append(reply)
            now = time.monotonic()
            if quorum_at is None and len(replies) >= cfg.min_clients:
                quorum_at = now
            verdict = wait_decision(sent, sent - len(pending), len(replies), cfg.min_clients, now - t0,
                                    None if quorum_at is None else now - quorum_at, cfg.round_timeout_s,
                                    cfg.grace_s)
            if verdict is not Wait.WAIT:
                break
            time.sleep(self.poll_s)
        for node in pending.values():
            failures[node] = "no reply in time"
        return replies, failures

    def _unwrap(self, node: int, msg: Message, shapes: list[tuple[int, ...]]) -> Reply | str:
        """A reply, or a fixed reason phrase why it is not one (never raises on peer data)."""
        if msg.has_error():
            return "client error"
        try:
            arrays = msg.content["arrays"].to_numpy_ndarrays()
            info = msg.content["info"] if "info" in msg.content.config_records else ConfigRecord({})
            metrics = msg.content["metrics"] if "metrics" in msg.content.metric_records else {}
            device = str(info.get("device-id", "")) or f"node-{node}"
            if [np.shape(a) for a in arrays] != shapes:
                return "shape mismatch"
            self.device_of[node] = device
            return Reply(device, node, tuple(np.asarray(a, dtype=np.float64) for a in arrays),
                         int(metrics.get("num-examples", 0)),
                         {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("malformed reply from node %d: %s", node, exc)
            return "malformed reply"


def _summaries(path: Path) -> list[FleetSummary]:
    """Latest FleetSummary frames the coordinator shell saved (one file per fog broker)."""
    out: list[FleetSummary] = []
    for p in sorted(path.glob("*.summary")) if path.is_dir() else []:
        try:
            msg = codec.decode(p.read_bytes())
        except (OSError, DecodeError) as exc:
            log.warning("ignoring summary %s: %s", p.name, exc)
            continue
        if isinstance(msg, FleetSummary):
            out.append(msg)
    return out


def _lock(path: Path, timeout_s: float) -> int:
    """One ServerApp per checkpoint directory: a stale run still dying must not write over us."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise FoglineError(f"checkpoint directory locked by another coordinator ({path})") from None
            time.sleep(0.5)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run or resume the configured rounds; write ``report.json`` next to the checkpoints."""
    from cloud_coordinator.aggregation import get_rule

    from .loop import run_rounds
    from .release import Releaser
    from .training import DigitsModelOps

    rc = dict(context.run_config)
    cfg = RunConfig.from_mapping(rc)
    dirs = [Path(p) for p in str(rc["checkpoint-dirs"]).split(os.pathsep) if p]
    dirs[0].mkdir(parents=True, exist_ok=True)
    lock_fd = _lock(dirs[0] / LOCK_FILE, float(rc.get("lock-timeout", 60.0)))
    try:
        policy = CheckpointPolicy(mode=str(rc.get("checkpoint-mode", "every-round")),
                                  keep=int(rc.get("keep", 3)), quorum=int(rc.get("quorum", 2)))
        store = CheckpointStore(dirs, policy)
        model = DigitsModelOps(str(rc.get("model-module", "models.train")))
        aggregator = get_rule(cfg.rule, cfg.f, seed=cfg.seed)
        summaries_dir = Path(str(rc.get("summaries-dir", ""))) if rc.get("summaries-dir") else None
        sel_policy = SelectionPolicy(battery_floor=float(rc.get("battery-floor", 0.3)))

        def select(rnd: int, nodes: dict[int, str]) -> Selection | None:
            assert summaries_dir is not None
            fleet = _summaries(summaries_dir)
            if not fleet:
                log.info("round %d: no fleet summaries, every connected node trains", rnd)
                return None
            sel = select_clients(fleet, time.time(), sel_policy, random.Random(f"{cfg.seed}/{rnd}"))
            log.info("round %d selection: %s", rnd, explain(sel))
            return sel

        releaser = Releaser.from_run_config(rc, dirs[0])
        t0 = time.monotonic()
        fleet = GridFleet(grid, extra_config={"model-module": model.module})
        report = run_rounds(cfg, fleet, model, store, aggregator, time.monotonic,
                            select=select if summaries_dir is not None else None,
                            after_round=releaser.after_round if releaser else None)
        doc = {"config_hash": report.config_hash, "rounds": cfg.rounds, "rounds_done": report.rounds_done,
               "resumed_from": report.resumed_from, "history": report.history,
               "skipped_checkpoints": report.skipped_checkpoints, "round_s": report.round_s,
               "checkpoint_s": report.checkpoint_s, "resume_s": report.resume_s,
               "wall_s": time.monotonic() - t0, "finished_at": time.time(),
               "releases": releaser.released if releaser else []}
        atomic_write(dirs[0] / REPORT_FILE, json.dumps(doc, indent=1, default=float).encode())
        log.info("done: %d rounds, final %s", cfg.rounds,
                 {k: v for k, v in report.history[-1].items() if k in ("accuracy", "loss")})
    finally:
        os.close(lock_fd)

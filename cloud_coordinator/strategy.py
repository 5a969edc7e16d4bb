"""``RobustStrategy``: Byzantine-robust rounds, checkpoints with resume and releases for any Flower App.

A Flower Message-API strategy (``flwr.serverapp.strategy.Strategy``): replace
``FedAvg(...)`` with ``RobustStrategy(...)`` in a ServerApp and keep calling
``strategy.start(grid=..., initial_arrays=..., num_rounds=..., evaluate_fn=...)``,
in the Deployment Engine or the Simulation Engine. What changes:

* replies are checked before anything is computed (layout, npy buffers,
  example counts; any exception while reading one is "malformed reply"), and
  every rejection is counted by reason in the round's metrics;
* the accepted replies are aggregated by a robust rule straight from their
  buffers (``aggregation.RowStack``: no decode, no stacking copy), the arrays
  of any ``ArrayRecord`` layout as one flat vector; example counts are ignored
  except by ``mean``; stateful rules keep their state across rounds;
* a round counts only with a quorum of usable replies (``aggregation.quorum``:
  the rule's minimum for ``f``, raised by ``min_replies``/``min_train_nodes``)
  and gives stragglers ``grace`` seconds once it has it; an attempt without
  one (or whose aggregation failed) is retried under the same round number,
  its reason in the log, ``progress.json`` and ``report.json``; after
  ``max_attempts`` the run stops loudly (``fatal.json``, no release);
* the reply deadline follows the machine (``rounds.round_deadline``: p95 of
  earlier reply times x a margin, from ``round_timeout`` up to
  ``max_round_timeout``) and Flower's message TTL is never shorter;
* with ``checkpoints=CheckpointConfig(dirs=...)`` every round is checkpointed, signed and
  quorum-replicated, and ``start`` resumes from the newest round verified in
  a quorum of replicas, so a killed run continues where it stopped;
* with ``release`` the global model is exported (the user's hook), checked in
  onnxruntime, signed and handed to the fog brokers, only when its bytes
  differ from the last release (an unchanged model is not a new version).

Under ``fogline coordinator --app`` the supervisor's settings (``settings``)
override rule, f, checkpoints, release and node identities.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.app.typing import MetricRecordValues
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from runtime.errors import FoglineError, LocalViolation
from runtime.security import Identity

from .aggregation import DEFAULT_RULE, AggregationError, Aggregator, describe, get_rule, quorum
from .checkpointing import (
    CHECKPOINT_KEY,
    CheckpointConfig,
    Checkpoints,
    Resumed,
    restore_metrics,
    signing_identity,
)
from .layout import (
    DUPLICATE_REPLY,
    MALFORMED,
    NO_ARRAYS,
    UNEXPECTED_REPLY,
    Layout,
    check_arrays,
    check_count,
    reason_key,
    stack_rows,
)
from .release import (
    Release,
    ReleaseError,
    Releaser,
)
from .replies import ReplyConfig, flower_error, median_metrics, reason_slug
from .rounds import (
    DeadlinePolicy,
    RoundConfig,
    Wait,
    message_ttl,
    round_deadline,
    starved_line,
    wait_decision,
)
from .runfiles import (
    RunFailed,
    lock_work_dir,
    record_failure,
    write_progress,
    write_report,
)
from .settings import (
    RELEASES_DIR,
    Settings,
    key_path,
    settings_for,
)
from .store import QuorumError
from .summaries import Selector
from .supernodes import KeyBook, devices_of

__all__ = ["RobustStrategy", "RoundConfig", "ReplyConfig", "CheckpointConfig", "Release", "RunFailed", "CHECKPOINT_KEY"]

log = logging.getLogger("fogline.strategy")
POLL_S = 0.2
REPLY_SAMPLES = 200  # reply times kept for the deadline (the newest)


def _from_grid(tb: TracebackType | None) -> bool:
    """Was this exception raised below a call into Flower's Grid (the SuperLink's connection, not the app)?"""
    return any(isinstance(f.f_locals.get("self"), Grid) for f, _ in traceback.walk_tb(tb))


@dataclass(slots=True)
class _Attempt:
    """What one training attempt sent, to whom, and what came back."""

    server_round: int
    number: int
    sent: dict[int, str] = field(default_factory=dict)          # node id -> device id
    refused: dict[int, str] = field(default_factory=dict)       # node id -> reason (before sending)
    connected: list[str] = field(default_factory=list)          # devices connected when it was configured
    rejected: dict[str, str] = field(default_factory=dict)      # device -> reason
    accepted: list[str] = field(default_factory=list)
    failure: str = ""
    answered: int = 0
    sites: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> its "site-*" metrics (two-level)
    t0: float = 0.0                                              # monotonic, before its Messages were made (TTL)
    deadline_s: float = 0.0
    selection: dict[str, str] = field(default_factory=dict)     # device -> why it was (not) selected (summaries)


def _settled(rounds: RoundConfig, replies: ReplyConfig, checkpoints: CheckpointConfig,
             settings: Mapping[str, Any]) -> tuple[RoundConfig, ReplyConfig, CheckpointConfig]:
    """The three records with the fields named directly applied: an app written for ``FedAvg``
    (``RobustStrategy(fraction_evaluate=0.0, min_train_nodes=3)``) runs unchanged. An unknown name
    is a TypeError naming it, with the closest known one."""
    import difflib
    from dataclasses import fields as fields_of
    records: list[Any] = [rounds, replies, checkpoints]
    changes: list[dict[str, Any]] = [{}, {}, {}]
    for name, value in settings.items():
        for i, rec in enumerate(records):
            if name in {f.name for f in fields_of(rec) if f.init}:
                changes[i][name] = value
                break
        else:
            known = [f.name for rec in records for f in fields_of(rec) if f.init]
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"RobustStrategy got an unexpected keyword argument {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
    out = [replace(rec, **ch) if ch else rec for rec, ch in zip(records, changes)]
    return out[0], out[1], out[2]


class RobustStrategy(Strategy):
    """Byzantine-robust, checkpointed, releasing drop-in for Flower's ``FedAvg``.

    ``rule`` is a rule of ``cloud_coordinator.aggregation`` (``preaggregator`` an
    optional ``+``-joined prefix such as ``"nnm"``); ``f`` the Byzantine clients to
    tolerate. ``RobustStrategy(rule, f)`` is the simple case; the rest comes in one frozen
    record per concern, defined beside the code that reads it: ``rounds`` (``RoundConfig``:
    sampling, quorum, deadlines), ``replies`` (``ReplyConfig``), ``checkpoints``
    (``CheckpointConfig``) and ``release``. A round counts with at least ``quorum`` usable
    replies (the rule's minimum, ``min_replies``, ``min_train_nodes``) and waits ``grace``
    seconds longer for stragglers once it has them; an attempt waits ``round_timeout``
    seconds for replies at first, then what earlier replies took (p95 x 3), up to
    ``max_round_timeout`` (default 5 x ``round_timeout``); ``max_attempts`` per round.
    """

    def __init__(self, rule: str = DEFAULT_RULE, f: int = 1, preaggregator: str | None = None, *,
                 rule_options: Mapping[str, Any] | None = None, seed: int = 0,
                 rounds: RoundConfig | None = None, replies: ReplyConfig | None = None,
                 checkpoints: CheckpointConfig | None = None, release: Release | None = None,
                 node_devices: Mapping[str, str] | None = None,
                 train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
                 evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
                 work_dir: str | Path | None = None, clock: Callable[[], float] = time.monotonic,
                 **settings: Any) -> None:
        self.rule = f"{preaggregator}+{rule}" if preaggregator else rule
        self.f = f
        self.rule_options = dict(rule_options or {})
        # one frozen record per concern, each defined beside the code that reads it; a field may
        # also be given by its own name, as Flower's FedAvg takes it (``fraction_evaluate=0.0``)
        self.rounds, self.replies, self.checkpoints = _settled(
            rounds or RoundConfig(), replies or ReplyConfig(), checkpoints or CheckpointConfig(), settings)
        self._reply_s: list[float] = []  # seconds from sending to each usable reply, earlier attempts
        self.deadline_s = self.rounds.round_timeout  # the current attempt's reply deadline
        self._status: dict[str, Any] = {}  # progress.json / fogline status: replies vs quorum, retries, deadline
        self._released: tuple[int, str] | None = None  # (version, sha256) of the newest release of the model
        self.signing_key = self.checkpoints.signing_key  # resolved to an Identity when first needed
        self.release = release
        self.seed = seed
        self.lineage = ""  # settings: a --new-lineage id, part of the config hash
        self.node_devices = dict(node_devices) if node_devices is not None else None  # key id -> device
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        self.work_dir = Path(work_dir) if work_dir else None
        self.settings: Settings | None = None
        self._selection: Selector | None = None  # settings: who may train, from the fogs' verified summaries
        self._aggregator = self._build_aggregator()  # bad rule names and options fail here, at once
        self._layout: Layout | None = None
        self._base: np.ndarray | None = None
        self._attempt: _Attempt | None = None
        self._eval_sent: dict[int, str] = {}
        self._dst_of: dict[str, int] = {}  # message id pushed -> the node it went to (blame the right node)
        self._devices: dict[int, str] = {}
        self._eval_t0: float | None = None
        self._measured: list[float] = []  # the last collect's reply times
        self._clock = clock  # reply deadlines and reply times (monotonic seconds; a test's virtual clock)

    # ------------------------------------------------------------------ configuration

    def _build_aggregator(self) -> Aggregator:
        self.deadline_policy = DeadlinePolicy.around(self.rounds.round_timeout, self.rounds.max_round_timeout)
        return get_rule(self.rule, self.f, seed=self.seed, **self.rule_options)

    @property
    def quorum(self) -> int:
        """Usable replies a round needs to count (``aggregation.quorum``: never fewer than the rule needs for ``f``)."""
        return quorum(self._aggregator.min_clients, self.rounds.min_replies, self.rounds.min_train_nodes)

    def apply_settings(self, s: Settings) -> None:
        """Let ``fogline coordinator``'s settings override the constructor (see ``settings``)."""
        self.settings = s
        self.work_dir = Path(s.work_dir)
        self.lineage = s.lineage
        if not s.client_evaluate and self.rounds.fraction_evaluate > 0.0:
            log.info("the ClientApp has no evaluate function: no evaluate Messages (fraction_evaluate %.2f -> 0)",
                     self.rounds.fraction_evaluate)
            self.rounds = replace(self.rounds, fraction_evaluate=0.0)
        if s.rule is not None:
            self.rule = s.rule
        if s.f is not None:
            self.f = s.f
        if s.seed is not None:
            self.seed = s.seed
        given = {name: getattr(s, name) for name in ("round_timeout", "grace", "min_train_nodes", "min_replies",
                                                     "max_round_timeout", "max_attempts")}
        self.rounds = replace(self.rounds, **{k: v for k, v in given.items() if v is not None})
        if s.checkpoint_dirs:
            self.checkpoints = replace(self.checkpoints, dirs=tuple(Path(d) for d in s.checkpoint_dirs),
                                       quorum=s.quorum, keep=s.keep, mode=s.checkpoint_mode)
        if s.signing_key:
            self.signing_key = Identity.load(s.signer, s.signing_key)
        if s.export:
            base = self.release
            self.release = Release(s.release_name or (base.name if base else "model"), s.export,
                                   s.release_every or (base.every if base else 1),
                                   s.input_shape or (base.input_shape if base else None))
        elif self.release is not None and (s.release_name or s.release_every):
            self.release = Release(s.release_name or self.release.name, self.release.export,
                                   s.release_every or self.release.every, self.release.input_shape)
        if s.supernodes:
            self.node_devices = KeyBook(s.supernodes).by_key_id()
        self._selection = Selector.from_settings(s, self.seed)  # a bad rule name stops here
        self._aggregator = self._build_aggregator()

    def summary(self) -> None:
        log.info("\t├──> RobustStrategy: %s, f=%d, quorum %d, timeout %.0f..%.0f s (+%.0f s grace), %d attempts",
                 describe(self.rule), self.f, self.quorum, self.deadline_policy.min_s, self.deadline_policy.max_s,
                 self.rounds.grace, self.rounds.max_attempts)
        log.info("\t├──> Sampling: train %.2f | evaluate %.2f", self.rounds.fraction_train,
                 self.rounds.fraction_evaluate)
        log.info("\t└──> Checkpoints: %s; release: %s",
                 ", ".join(map(str, self.checkpoints.dirs)) or "none",
                 f"{self.release.name} every {self.release.every}" if self.release else "none")

    def config_hash(self, layout: Layout, train_config: ConfigRecord | None = None) -> str:
        """What determines the trained model; a checkpoint of another hash is never resumed."""
        ident = {"rule": self.rule, "f": self.f, "options": sorted((k, repr(v)) for k, v in self.rule_options.items()),
                 "seed": self.seed, "layout": layout.digest(),
                 "config": sorted((k, repr(v)) for k, v in (train_config or {}).items())}
        if self.lineage:  # --new-lineage: the old lineage's checkpoints never match
            ident["lineage"] = self.lineage
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ nodes

    def _node_map(self, grid: Grid) -> tuple[dict[int, str], dict[int, str]]:
        """Connected nodes -> device ids (authenticated keys when known), and refused nodes."""
        if self.node_devices is None:
            nodes = [(int(n), b"") for n in grid.get_node_ids()]
        else:
            nodes = [(int(n.node_id), bytes(n.public_key)) for n in grid.get_nodes()]
        devices, refused = devices_of(nodes, self.node_devices)
        self._devices.update(devices)
        return devices, refused

    # ------------------------------------------------------------------ Flower API: training

    def prepare(self, arrays: ArrayRecord) -> None:
        """Fix the global model of the round about to be configured (layout, flat base)."""
        layout = Layout.of(arrays)
        if self._layout is not None and layout != self._layout:
            raise LocalViolation("the global arrays changed layout between rounds")
        self._layout = layout
        self._base = layout.flat(arrays)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample nodes (seeded, at least the quorum), one Message each with the arrays and config."""
        if self.rounds.fraction_train == 0.0:
            return []
        self.prepare(arrays)
        number = 1 if self._attempt is None or self._attempt.server_round != server_round else (
            self._attempt.number + 1)
        att = _Attempt(server_round, number)
        self._attempt = att
        devices, att.refused = self._node_map(grid)
        att.connected = sorted(devices.values())
        sel = self._selection
        eligible = devices if sel is None else sel.eligible(server_round, devices)[0]
        att.selection = dict(sel.last["devices"]) if sel is not None and sel.last is not None and \
            sel.last["round"] == server_round else {}
        nodes = sorted(eligible)
        k = min(len(nodes), max(math.ceil(self.rounds.fraction_train * len(nodes)), self.quorum))
        rng = np.random.default_rng([self.seed, server_round, number])
        picked = sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=k, replace=False)) if k else []
        att.sent = {n: eligible[n] for n in picked}
        att.t0, att.deadline_s = self._clock(), self.deadline_s  # the TTL and the deadline count from here
        if len(picked) >= self.quorum:  # the heartbeat also under Flower's own round loop (no start())
            self._progress(server_round, number, f"round {server_round} attempt {number}: waiting for replies of "
                           f"{len(picked)} nodes (quorum {self.quorum}, deadline {self.deadline_s:.3g} s)",
                           att.connected, att.sent.values())
        # round-timeout: how long this attempt waits, so a site (bridge) answers before the cloud gives up
        cfg = ConfigRecord({**dict(config), "server-round": server_round, "round-timeout": float(self.deadline_s)})
        content = RecordDict({self.replies.arrayrecord_key: arrays, self.replies.configrecord_key: cfg})
        ttl = message_ttl(self.deadline_s, self.rounds.grace)
        return [Message(content, dst_node_id=n, message_type=MessageType.TRAIN, group_id=str(server_round),
                        ttl=ttl) for n in picked]

    def _origin(self, msg: Message) -> int:
        """The node a reply speaks for: an error the SuperLink generated (node unavailable, reply expired)
        carries the SuperLink's own node id; it is about the node our message went to."""
        src = int(msg.metadata.src_node_id)
        if src == SUPERLINK_NODE_ID:
            return self._dst_of.get(str(msg.metadata.reply_to_message_id), src)
        return src

    def _read_reply(self, msg: Message, layout: Layout,
                    seen: set[int]) -> tuple[int, str, list[np.ndarray], float] | str:
        """(node, device, zero-copy views, example count) of a usable reply, or the reason it is not."""
        att = self._attempt
        node = self._origin(msg)
        if att is not None and node not in att.sent:
            return UNEXPECTED_REPLY
        if node in seen:
            return DUPLICATE_REPLY
        seen.add(node)
        if msg.has_error():
            return flower_error(msg)
        content = msg.content
        records = content.array_records
        if len(records) != 1:
            return NO_ARRAYS if not records else MALFORMED
        views = check_arrays(layout, next(iter(records.values())))
        if isinstance(views, str):
            return views
        count: float | str = 0.0
        for rec in content.metric_records.values():
            if self.replies.weighted_by_key in rec:
                count = check_count(rec[self.replies.weighted_by_key], self.replies.max_examples)
        if isinstance(count, str):
            return count
        device = att.sent[node] if att is not None else self._devices.get(node, f"node-{node}")
        return node, device, views, count

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, aggregate the accepted ones robustly; (None, metrics) when the attempt fails."""
        if self._layout is None or self._base is None:
            raise LocalViolation("aggregate_train before configure_train (or prepare)")
        layout, base = self._layout, self._base
        att = self._attempt if self._attempt is not None and self._attempt.server_round == server_round else (
            _Attempt(server_round, 1))
        att.rejected, att.accepted, att.failure = {}, [], ""
        att.sites = {}
        good: list[tuple[str, int, list[np.ndarray], float, RecordDict]] = []
        seen: set[int] = set()
        n_replies = 0
        for msg in replies:
            n_replies += 1
            try:
                got = self._read_reply(msg, layout, seen)
            except Exception as exc:  # noqa: BLE001 - a reply our reader chokes on is MALFORMED, not the round's end
                log.warning("reply from node %s: %s: %s", getattr(msg.metadata, "src_node_id", "?"),
                            type(exc).__name__, exc)
                got = MALFORMED
            if isinstance(got, str):
                try:
                    node = self._origin(msg)
                except (AttributeError, TypeError, ValueError):  # metadata without a usable node id
                    node = 0
                who = (att.sent.get(int(node)) if att.sent else None) or f"node-{node}"
                att.rejected[who if who not in att.rejected else f"{who}#{len(att.rejected)}"] = got
                continue
            node, device, views, count = got
            good.append((device, node, views, count, msg.content))
            site = {k: float(v) for rec in msg.content.metric_records.values() for k, v in rec.items()
                    if k.startswith("site-") and isinstance(v, (int, float)) and math.isfinite(v)}
            if site:  # a site's own counts (site_aggregator.bridge): kept per site, not medianed away
                att.sites[device] = site
        att.answered = n_replies
        good.sort(key=lambda g: (g[0], g[1]))  # device-id order: arrival order never matters
        metrics = self._round_metrics(att, len(good), n_replies)
        if len(good) < self.quorum:
            att.failure = (f"{self._aggregator.name} with f={self.f} needs {self.quorum} usable replies, "
                           f"got {len(good)} of {n_replies}")
            metrics["failed"] = 1
            return None, MetricRecord(metrics)
        stack = stack_rows(g[2] for g in good)
        weights = np.array([g[3] for g in good]) if self._aggregator.name.split("+")[-1] == "mean" else None
        if weights is not None and not weights.sum() > 0:
            weights = None
        try:
            res = self._aggregator.aggregate(stack, weights, base=base)
            new = base + res.update
            if not np.isfinite(new).all():
                raise AggregationError("the aggregate is not finite")
        except (AggregationError, ArithmeticError, ValueError, MemoryError) as exc:
            att.failure = f"aggregation failed: {exc}"
            log.warning("round %d: %s", server_round, att.failure)
            metrics["failed"] = 1
            return None, MetricRecord(metrics)
        for i, why in res.rejected.items():
            att.rejected[good[i][0]] = why
        att.accepted = [good[i][0] for i in res.selected]
        metrics = self._round_metrics(att, len(good), n_replies)
        arrays = ArrayRecord({name: Array(a) for name, a in zip(layout.names, layout.split(new))})
        contents = [good[i][4] for i in res.selected]
        try:
            extra = (dict(self.train_metrics_aggr_fn(contents, self.replies.weighted_by_key))
                     if self.train_metrics_aggr_fn else median_metrics(contents, self.replies.weighted_by_key))
        except Exception as exc:  # noqa: BLE001 - the user's aggregation function may raise anything
            log.warning("train metrics aggregation failed: %s", exc)
            extra = {}
        return arrays, MetricRecord({**extra, **metrics})

    def _round_metrics(self, att: _Attempt, usable: int, replies: int) -> dict[str, MetricRecordValues]:
        out: dict[str, MetricRecordValues] = {"replies": replies, "usable": usable, "accepted": len(att.accepted),
                               "rejected": len(att.rejected), "attempt": att.number,
                               "refused-nodes": len(att.refused)}
        for why, n in Counter(reason_key(w) for w in att.rejected.values()).items():
            out[f"rejected-{reason_slug(why)}"] = n
        return out

    # ------------------------------------------------------------------ Flower API: evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.rounds.fraction_evaluate == 0.0:
            return []
        devices, _ = self._node_map(grid)
        nodes = sorted(devices)
        k = min(len(nodes), max(math.ceil(self.rounds.fraction_evaluate * len(nodes)), self.rounds.min_evaluate_nodes))
        rng = np.random.default_rng([self.seed, server_round, 0xE7A1])
        picked = sorted(nodes[int(i)] for i in rng.choice(len(nodes), size=k, replace=False)) if k else []
        self._eval_sent = {n: devices[n] for n in picked}
        self._eval_t0 = self._clock()
        cfg = ConfigRecord({**dict(config), "server-round": server_round})
        content = RecordDict({self.replies.arrayrecord_key: arrays, self.replies.configrecord_key: cfg})
        return [Message(content, dst_node_id=n, message_type=MessageType.EVALUATE, group_id=str(server_round),
                        ttl=message_ttl(self.deadline_s, self.rounds.grace)) for n in picked]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Median of the clients' evaluation metrics (robust), plus how many answered."""
        ok: list[RecordDict] = []
        bad = 0
        for msg in replies:
            try:
                if msg.has_error() or int(msg.metadata.src_node_id) not in self._eval_sent:
                    bad += 1
                    continue
                ok.append(msg.content)
            except (AttributeError, TypeError, ValueError):  # a reply without usable metadata or content
                bad += 1
        if not ok:
            return None
        try:
            out = (dict(self.evaluate_metrics_aggr_fn(ok, self.replies.weighted_by_key))
                   if self.evaluate_metrics_aggr_fn else median_metrics(ok, self.replies.weighted_by_key))
        except Exception as exc:  # noqa: BLE001 - the user's aggregation function may raise anything
            log.warning("evaluate metrics aggregation failed: %s", exc)
            out = {}
        return MetricRecord({**out, "replies": len(ok), "rejected": bad})

    # ------------------------------------------------------------------ the round loop

    def _collect(self, grid: Grid, messages: list[Message], need: int, timeout: float,
                 t0: float | None = None, *, measure: bool = False) -> list[Message]:
        """Push, then poll until everyone answered, or a quorum plus grace, or the deadline.

        ``t0`` (monotonic): when the Messages were made; the deadline counts from there, as their
        TTL does. ``measure``: keep each usable reply's time for the next deadlines (``_measured``).
        """
        measured: list[float] = []
        self._measured = measured
        if not messages:
            return []
        t0 = self._clock() if t0 is None else t0
        ids = list(grid.push_messages(messages))
        pending = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}
        self._dst_of = dict(pending)
        sent = len(pending)
        got: list[Message] = []
        ok = 0
        quorum_at: float | None = None
        while pending:
            pulled = list(grid.pull_messages(list(pending)))
            now = self._clock()
            for msg in pulled:
                if pending.pop(msg.metadata.reply_to_message_id, None) is None:
                    continue
                got.append(msg)
                if not msg.has_error():
                    ok += 1
                    measured.append(now - t0)
            if quorum_at is None and ok >= need:
                quorum_at = now
            verdict = wait_decision(sent, sent - len(pending), ok, need, now - t0,
                                    None if quorum_at is None else now - quorum_at, timeout, self.rounds.grace)
            if verdict is not Wait.WAIT:
                break
            time.sleep(POLL_S)
        if measure:
            self._reply_s = (self._reply_s + measured)[-REPLY_SAMPLES:]
        return got

    def _wait_nodes(self, grid: Grid, need: int, timeout: float) -> int:
        deadline = self._clock() + timeout
        while (have := len(list(grid.get_node_ids()))) < need and self._clock() < deadline:
            time.sleep(0.5)
        return have

    def _checkpoints(self) -> Checkpoints | None:
        """The checkpoint collaborator of this run (None without ``checkpoint_dirs``)."""
        if not self.checkpoints.dirs:
            return None
        self.signing_key = signing_identity(self.signing_key, key_path(self.checkpoints.dirs[0], CHECKPOINT_KEY))
        return Checkpoints(self.checkpoints.dirs, self.signing_key, mode=self.checkpoints.mode,
                           keep=self.checkpoints.keep, quorum=self.checkpoints.quorum)

    def _signer(self) -> Identity:
        """The release signer: the checkpoints' key, or one kept with the keys beside the work directory."""
        assert self.work_dir is not None
        self.signing_key = signing_identity(self.signing_key, key_path(self.work_dir, CHECKPOINT_KEY))
        return self.signing_key

    def _progress(self, rnd: int, attempt: int, waiting: str, connected: Iterable[str] = (),
                  eligible: Iterable[str] = ()) -> None:
        """The heartbeat the supervisor's watchdog reads: which round, and what it waits for (a line)."""
        if self.work_dir is None:
            return
        doc = {"round": rnd, "attempt": attempt, "waiting": waiting, "connected": sorted(connected),
               "eligible": sorted(eligible), "at": time.time(), **self._status}
        if self._selection is not None and self._selection.last is not None:  # fogline status: who trains, why not
            doc["selection"] = self._selection.last
        write_progress(self.work_dir, doc)

    def _fail(self, text: str, trace: str = "") -> RunFailed:
        return record_failure(self.work_dir, text, trace)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run (or resume) ``num_rounds`` rounds; Flower's ``Result`` with every round's metrics."""
        lock = -1
        try:
            lock = self._begin(grid)
            num_rounds = self.settings.rounds or num_rounds if self.settings is not None else num_rounds
            return self._run(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)
        except RunFailed:
            raise
        except Exception as exc:
            # The app's own code (a strategy method, evaluate_fn, the export hook) raised: no restart can help,
            # so say so once (fatal.json, with the traceback) instead of resubmitting a run that fails the same way.
            # An exception from inside a Grid call is Flower's connection (the SuperLink went away): the
            # supervisor restarts that.
            if self.work_dir is None or _from_grid(exc.__traceback__):
                raise
            where = traceback.extract_tb(exc.__traceback__)[-1]
            raise self._fail(f"the ServerApp raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]} "
                             f"({Path(where.filename).name}:{where.lineno} in {where.name})",
                             traceback.format_exc()) from exc
        finally:
            if lock >= 0:
                os.close(lock)

    def _begin(self, grid: Grid) -> int:
        """Apply the supervisor's settings (if any) and lock the work directory against a stale run."""
        try:
            s = settings_for(getattr(grid.run, "override_config", None))
        except Exception as exc:
            if isinstance(exc, LocalViolation):
                raise
            s = None
        if s is not None:
            self.apply_settings(s)
        if self.work_dir is None and self.checkpoints.dirs:
            self.work_dir = self.checkpoints.dirs[0]
        if self.work_dir is None:
            return -1
        return lock_work_dir(self.work_dir)

    def _run(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int, timeout: float,
             train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None,
             evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None) -> Result:
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        t_start = time.monotonic()
        layout = Layout.of(initial_arrays)
        chash = self.config_hash(layout, train_config)
        try:
            ckpts = self._checkpoints()
        except FoglineError as exc:
            raise self._fail(f"checkpoints: {exc}") from None
        result = Result(arrays=initial_arrays)
        start = Resumed(initial_arrays) if ckpts is None else ckpts.resume(chash, layout, initial_arrays,
                                                                           self._aggregator, num_rounds)
        history, arrays, start_round, restarts = start.history, start.arrays, start.start_round, start.restarts
        result.arrays = arrays
        restore_metrics(result, history)
        releaser = None if self.release is None else Releaser(self.release, self._signer)
        if releaser is not None:
            try:
                releaser.check(arrays)
            except ReleaseError as exc:
                raise self._fail(str(exc)) from None
        if evaluate_fn is not None and start_round == 1:
            res0 = evaluate_fn(0, arrays)
            if res0 is not None:
                result.evaluate_metrics_serverapp[0] = res0
        round_s: list[float] = []
        releases: list[dict[str, Any]] = []
        self._reply_s = [float(x) for h in history for x in h.get("reply_s", ())][-REPLY_SAMPLES:]  # resumed
        for rnd in range(start_round, num_rounds + 1):
            r0 = time.monotonic()
            entry: dict[str, Any] = {"round": rnd}
            new_arrays, train_metrics = self._train_round(grid, rnd, arrays, train_config, timeout, entry)
            wait = min(self.deadline_s, timeout)
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
                entry["train"] = dict(train_metrics)
            eval_msgs = list(self.configure_evaluate(rnd, arrays, ConfigRecord(dict(evaluate_config)), grid))
            if eval_msgs:
                agg_eval = self.aggregate_evaluate(rnd, self._collect(
                    grid, eval_msgs, self.rounds.min_evaluate_nodes, wait, self._eval_t0))
                if agg_eval is not None:
                    result.evaluate_metrics_clientapp[rnd] = agg_eval
                    entry["evaluate"] = dict(agg_eval)
            if evaluate_fn is not None:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
                    entry["server"] = dict(res)
                    entry.update({k: v for k, v in dict(res).items() if k not in entry})  # e.g. "accuracy"
            history.append(entry)
            round_s.append(time.monotonic() - r0)
            self._progress(rnd, int(entry.get("attempt", 0)), f"round {rnd} of {num_rounds} done: "
                           f"{entry.get('replies', 0)}/{entry.get('quorum', 0)} replies of its quorum")
            if ckpts is not None:
                try:
                    ckpts.after_round(rnd, num_rounds, arrays, chash, self._aggregator, self.seed, history, restarts,
                                      round_s)
                except QuorumError as exc:
                    raise self._fail(f"stopping: {exc}; the run resumes from round {ckpts.last}") from None
            if releaser is not None and releaser.release.due(rnd, num_rounds):
                if self.work_dir is None:
                    self.work_dir = Path.cwd() / "fogline-run"
                releases.append(releaser.publish(rnd, arrays, entry, self.work_dir / RELEASES_DIR))
            log.info("round %d: %s", rnd, {k: v for k, v in entry.items() if k in ("accepted", "skipped", "server")})
        if self.work_dir is not None:
            doc = {"config_hash": chash, "rounds": num_rounds, "rounds_done": num_rounds,
                   "resumed_from": start.resumed_from, "history": history, "round_s": round_s,
                   "checkpoint_s": ckpts.seconds if ckpts is not None else [], "resume_s": start.seconds,
                   "skipped_checkpoints": start.skipped, "releases": releases,
                   "wall_s": time.monotonic() - t_start, "finished_at": time.time(), "done": True}
            write_report(self.work_dir, doc)
        return result

    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord, train_config: ConfigRecord,
                    wait: float | None = None) -> tuple[ArrayRecord | None, MetricRecord | None, dict[str, Any]]:
        """One robust training round on ``grid`` outside ``start`` (a fog site's half of a two-level round).

        (aggregate or None, metrics, entry): ``entry`` names the clients, the accepted, the rejected
        with reasons and, when the round could not aggregate, why (``skipped``). Never stops a run:
        too few clients is this round's failure, not the configuration's.
        """
        entry: dict[str, Any] = {"round": server_round}
        new, metrics = self._train_round(grid, server_round, arrays, train_config,  # wait: the cloud's deadline
                                         math.inf if wait is None else wait, entry, fatal=False)
        return new, metrics, entry

    def _train_round(self, grid: Grid, rnd: int, arrays: ArrayRecord, train_config: ConfigRecord,
                     cap: float, entry: dict[str, Any], *,
                     fatal: bool = True) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Up to ``max_attempts`` attempts under round number ``rnd``, each waiting at most its adapted deadline
        (never beyond ``cap``); a round without a quorum is not a round: the run stops (``fatal``), or, for a
        site's half of a two-level round, the model is kept and ``entry`` says why (``skipped``)."""
        metrics: MetricRecord | None = None
        failures: list[str] = []
        retried: list[str] = []
        too_few = 0  # attempts that could not even reach the quorum's number of clients
        starved = 0  # attempts whose replies did not reach the quorum by the deadline
        q = self.quorum
        for number in range(1, self.rounds.max_attempts + 1):
            self.deadline_s = min(round_deadline(self.deadline_policy, self._reply_s, starved), cap)
            self._status = {"quorum": q, "deadline_s": round(self.deadline_s, 1), "grace_s": self.rounds.grace,
                            "retries": len(retried),
                            "max_attempts": self.rounds.max_attempts, **({"retried": retried[-1]} if retried else {})}
            need = max(q, self.rounds.min_available_nodes)
            self._progress(rnd, number, f"round {rnd} attempt {number}: waiting for {need} nodes to connect")
            have = self._wait_nodes(grid, need, self.deadline_s)
            msgs = list(self.configure_train(rnd, arrays, ConfigRecord(dict(train_config)), grid))
            att = self._attempt
            assert att is not None
            if att.selection:  # report.json: every device, selected or why not (the fog's summaries)
                entry["selection"] = {"rule": self._selection.rule if self._selection else "",
                                      "devices": dict(att.selection)}
            connected = att.connected
            if len(msgs) < q:
                att.failure = (f"{self._aggregator.name} with f={self.f} needs {q} clients, "
                               f"{len(msgs)} eligible of {have} connected")
                too_few += 1
                why = att.failure
            else:
                replies = self._collect(grid, msgs, q, att.deadline_s, att.t0, measure=True)
                new, metrics = self.aggregate_train(rnd, replies)
                got = metrics.get("usable", 0) if metrics is not None else 0
                usable = int(got) if isinstance(got, (int, float)) else 0
                entry.update({"clients": sorted(att.sent.values()), "accepted": att.accepted,
                              "rejected": dict(att.rejected), "attempt": number,
                              "refused_nodes": {str(k): v for k, v in att.refused.items()},
                              "no_reply": sorted(set(att.sent.values()) - set(att.accepted) - set(att.rejected)),
                              "replies": usable, "quorum": q, "deadline_s": round(att.deadline_s, 1),
                              "reply_s": [round(x, 3) for x in self._measured]})
                if att.sites:
                    entry["sites"] = dict(att.sites)
                if new is not None:
                    if retried:
                        entry["retried"] = retried
                    self._status.update(replies=usable, retries=len(retried))
                    return new, metrics
                if usable < q:
                    # a longer deadline helps only when someone did not answer in time
                    starved += 1 if att.answered < len(att.sent) else 0
                    bad = att.answered - usable
                    why = (f"{starved_line(usable, len(att.sent), att.deadline_s)} (quorum {q}"
                           f"{f', {bad} unusable' if bad else ''})")
                else:
                    why = att.failure
            failures.append(why)
            if number < self.rounds.max_attempts:
                retried.append(why)
                self._status.update(retries=len(retried), retried=why)
                log.warning("round %d retried: %s", rnd, why)
            else:
                log.warning("round %d attempt %d failed: %s", rnd, number, why)
            self._progress(rnd, number, f"round {rnd} attempt {number}: {why}"
                           f"{'; retrying' if number < self.rounds.max_attempts else ''}", connected, att.sent.values())
        if retried:
            entry["retried"] = retried
        last = failures[-1] if failures else "no attempt"
        if fatal:
            if too_few == self.rounds.max_attempts:  # never enough clients for this rule and f: the configuration
                raise self._fail(f"round {rnd}: {last}; lower f, use another rule or add clients")
            raise self._fail(f"round {rnd} failed {self.rounds.max_attempts} attempts, last: {last}; the model is "
                             f"unchanged since round {rnd - 1} and nothing was released")
        entry["skipped"] = last
        log.error("round %d skipped, the model is unchanged: %s", rnd, entry["skipped"])
        return None, metrics

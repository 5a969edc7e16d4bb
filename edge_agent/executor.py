"""Partition executor: one onnxruntime session per partition, a bounded queue, worker threads.

Activations come in already checked (``runtime.relay``: fog-signed route,
signed by the previous hop); each is run by the partition its hop names, then
forwarded to the next hop as a frame sealed by this device or, after the last,
answered to ``reply_to`` sealed by this device. Nothing is dropped silently: a full queue, a missing
partition, a past deadline or a failed run becomes
``InferenceResult(ok=False, error=...)`` to ``reply_to``. onnxruntime is
imported on the first load, so an idle agent never pays for it.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from runtime import activations
from runtime.errors import RemoteViolation
from runtime.messages import Activation, InferenceResult, PartitionStatus
from runtime.relay import Sealer
from runtime.topics import Topics, parse

from . import batching
from .probes.providers import best as best_providers
from .stats import LatencyWindow

__all__ = ["Executor", "PartitionKey", "LoadError"]

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int, int, int]  # workload, version, replica, index
Publish = Callable[[str, bytes], None]

_STOP = object()


@dataclass(frozen=True, slots=True)
class _Sealed:
    """A frame as it came off the wire, opened and checked on a worker (``Executor.opener``)."""
    raw: Any


@dataclass(frozen=True, slots=True)
class _Ready:
    """An activation checked and decoded, with its partition and the feeds it runs with."""
    act: Activation
    part: _Partition
    feeds: dict[str, Any]


def _rows(feeds: dict[str, Any], names: tuple[str, ...]) -> int:
    first = feeds[names[0]] if names else None
    return int(first.shape[0]) if first is not None and getattr(first, "ndim", 0) > 0 else 1


def _split(outs: list[Any], rows: list[int]) -> list[list[Any]] | None:
    """Each frame's slices of a batch's outputs (in order); None when an output lacks the batch axis."""
    total = sum(rows)
    if any(o.ndim == 0 or o.shape[0] != total for o in outs):
        return None
    bounds = np.cumsum(rows)[:-1]
    per = [np.split(o, bounds) for o in outs]
    return [[p[i] for p in per] for i in range(len(rows))]


class LoadError(Exception):
    """onnxruntime could not load an artifact (the message says why)."""


@dataclass
class _Partition:
    key: PartitionKey
    sha256: str
    memory_bytes: int
    session: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    latency: LatencyWindow = field(default_factory=LatencyWindow)
    served: int = 0
    errors: int = 0
    health: str = "running"
    flops: float | None = None  # per sample (leading dim 1), for the simulated compute delay
    calib_s: float = 0.0  # one request's compute, timed at load (the calibration the fog learns from)
    joules: float = 0.0  # one request's energy on this board (probes.energy), 0.0: not known
    energy_measured: bool = False
    # simulated device whose partition's FLOPs need real input shapes: sized on its first request
    sim_artifact: bytes = b""
    # inputs with open sizes beyond the batch: made-up inputs say nothing, the first request times it
    calib_on_first: bool = False
    batchable: bool = False  # every input has an open leading (batch) dimension
    cost: batching.BatchCost = field(default_factory=batching.BatchCost)


# onnxruntime's input type strings -> numpy dtypes the calibration feeds with
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
               "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _calibration_feeds(session: Any) -> dict[str, Any] | None:
    """Inputs made from a session's own signature (dynamic dims taken as 1); None: unknown types."""
    feeds: dict[str, Any] = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        dtype = _ORT_DTYPES.get(i.type)
        if dtype is None:
            return None
        feeds[i.name] = (np.random.default_rng(0).standard_normal(shape).astype(dtype)
                         if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype))
    return feeds


def _sample_flops(artifact: bytes, feeds: dict[str, Any]) -> float | None:
    """FLOPs of one sample through a partition with these inputs' shapes (leading dim 1)."""
    try:
        import warnings

        from models.graph import load_model
        from models.probe import analyze
        from models.profile import profile_model

        shapes = {n: [1, *v.shape[1:]] if v.ndim else [] for n, v in feeds.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ga = analyze(load_model(artifact), input_shapes=shapes)
            return float(profile_model(ga).flops) or None
    except Exception:
        log.debug("cannot size partition", exc_info=True)
        return None


def _ort() -> Any:
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    return onnxruntime


class Executor:
    def __init__(self, device_id: str, topics: Topics, publish: Publish, sealer: Sealer, *,
                 intra_op_threads: int = 0, workers: int = 1, queue_size: int = 64, slowdown: float = 1.0,
                 device_flops: float | None = None, batch: batching.BatchPolicy | None = None,
                 sim_batch_slope: float = 1.0) -> None:
        self.device_id = device_id
        self.topics = topics
        self._publish = publish
        self._sealer = sealer
        self._seal_lock = threading.Lock()
        self.intra_op_threads = intra_op_threads
        self.workers = max(1, workers)
        self.slowdown = slowdown
        self.device_flops = device_flops  # set: simulated device, runs take at least flops/device_flops
        self.batch = batch or batching.BatchPolicy()
        # simulated device class: a batch of n samples takes one's time x (1 + slope (n - 1))
        self.sim_batch_slope = sim_batch_slope
        self.batches = 0         # batches of more than one frame run
        self.batched_frames = 0  # frames in them
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._parts: dict[PartitionKey, _Partition] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.busy_s = 0.0  # cumulative compute seconds (simulated battery drain uses it)
        self.rejected_overload = 0
        self.expired = 0  # activations dropped uncomputed: their deadline passed while queued
        self.errors_replied = 0
        self.forwarded = 0
        self.answered = 0
        self.undeliverable = 0
        self.providers: tuple[str, ...] = ()
        # Opens and checks a frame handed over by ``submit_sealed`` (signatures, replay): None drops it
        # (the opener counted why). Set by the agent; workers run it, not the network thread.
        self.opener: Callable[[Any], Activation | None] | None = None
        # The board's meter (LiveProbe.measure_energy) and the modelled draw where it has none.
        self.measure_energy: Callable[[Callable[[int], None], int], Any] | None = None
        self.power_active_w = 0.0

    # ------------------------------------------------------------ partitions (agent thread)

    def load(self, key: PartitionKey, sha256: str, artifact: bytes, memory_bytes: int,
             flops: float | None = None) -> None:
        """Create the session (replacing one with the same key); raise LoadError."""
        ort = _ort()
        opts = ort.SessionOptions()
        if self.intra_op_threads:
            opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # Partition bytes are data, never paths: ONNX external data would be read from this
        # process's working directory. Under os.devnull (no directory) it resolves nowhere.
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", os.devnull)
        available = ort.get_available_providers()
        wanted = best_providers(available)
        try:
            session = ort.InferenceSession(artifact, sess_options=opts, providers=wanted)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises many types for bad models
            raise LoadError(f"{type(exc).__name__}: {str(exc)[:200]}") from None
        self.providers = tuple(session.get_providers())
        part = _Partition(key, sha256, memory_bytes, session,
                          tuple(i.name for i in session.get_inputs()),
                          tuple(o.name for o in session.get_outputs()), flops=flops)
        if self.device_flops and not flops:
            part.sim_artifact = artifact
        part.batchable = bool(part.inputs) and all(
            len(i.shape) > 0 and not (isinstance(i.shape[0], int) and i.shape[0] > 0) for i in session.get_inputs())
        part.calib_on_first = any(not isinstance(d, int) or d <= 0
                                  for i in session.get_inputs() for d in list(i.shape)[1:])
        part.calib_s = 0.0 if part.calib_on_first else self._calibrate(session, flops)
        part.joules, part.energy_measured = self._energy(session, part.calib_s)
        with self._lock:
            self._parts[key] = part
        self._ensure_workers()

    def _calibrate(self, session: Any, flops: float | None) -> float:
        """Time one request of a freshly loaded partition on this device (median of a few runs).

        Inputs are made from the session's own signature (dynamic dims taken as 1). A simulated
        device reports the compute it models, as the data path does. 0.0 when it cannot run.
        """
        feeds = _calibration_feeds(session)
        if feeds is None:
            return 0.0
        times: list[float] = []
        try:
            session.run(None, feeds)  # warm up (allocations, first-run kernels)
            for _ in range(5):
                t0 = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - t0)
                if times[-1] > 0.2:  # a heavy partition: one timing is enough
                    break
        except Exception:  # noqa: BLE001 - a partition that needs real inputs simply gets no calibration
            return 0.0
        measured = sorted(times)[len(times) // 2] * max(self.slowdown, 1.0)
        if self.device_flops and flops:
            measured = max(measured, flops / self.device_flops)
        return measured

    def _energy(self, session: Any, calib_s: float) -> tuple[float, bool]:
        """(joules per request, measured?): a batch on the board's meter, else the modelled figure."""
        from .probes import energy

        feeds = _calibration_feeds(session)
        if self.measure_energy is not None and feeds is not None and calib_s > 0 and not self.device_flops:
            def batch(n: int) -> None:
                for _ in range(n):
                    session.run(None, feeds)
            try:
                fig = self.measure_energy(batch, energy.batch_size(calib_s))
            except Exception:  # noqa: BLE001 - a failing meter leaves the modelled figure
                fig = None
            if fig is not None:
                return fig.joules_per_inference, True
        return energy.modelled(self.power_active_w, calib_s).joules_per_inference, False

    def unload(self, key: PartitionKey) -> _Partition | None:
        with self._lock:
            return self._parts.pop(key, None)

    def get(self, key: PartitionKey) -> _Partition | None:
        with self._lock:
            return self._parts.get(key)

    def reserved_memory(self) -> int:
        with self._lock:
            return sum(p.memory_bytes for p in self._parts.values())

    def statuses(self) -> tuple[PartitionStatus, ...]:
        with self._lock:
            parts = sorted(self._parts.values(), key=lambda p: p.key)
        return tuple(PartitionStatus(p.key[0], p.key[1], p.key[2], p.key[3], p.sha256, p.health,
                                     p.latency.p(50), p.latency.p(99), p.served, p.errors,
                                     round(p.calib_s, 6), round(p.joules, 9), p.energy_measured,
                                     self.batch.max_batch if p.batchable else 1, round(p.cost.slope, 4))
                     for p in parts)

    # ------------------------------------------------------------ data plane (any thread)

    def submit(self, act: Activation) -> None:
        """Queue an activation; when the queue is full, answer an error at once (backpressure)."""
        try:
            self._queue.put_nowait(act)
        except queue.Full:
            self.rejected_overload += 1
            self._fail(act, "overloaded: queue full")

    def submit_sealed(self, raw: Any) -> None:
        """Queue a frame still to be opened by ``opener`` on a worker (the agent's network thread
        calls this: no signature check there). A full queue opens it here to answer the error."""
        try:
            self._queue.put_nowait(_Sealed(raw))
        except queue.Full:
            self.rejected_overload += 1
            act = self._open(raw)
            if act is not None:
                self._fail(act, "overloaded: queue full")

    def _open(self, raw: Any) -> Activation | None:
        if self.opener is None:
            log.error("%s: a sealed frame but no opener", self.device_id)
            return None
        return self.opener(raw)

    def _ensure_workers(self) -> None:
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._run, name=f"exec-{self.device_id}-{len(self._threads)}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()

    def _run(self) -> None:
        deferred: collections.deque[Any] = collections.deque()  # taken while batching, not batched
        while True:
            item = deferred.popleft() if deferred else self._queue.get()
            if item is _STOP:
                return
            act = self._take(item)
            if act is None:
                continue
            try:
                ready = self._prepare(act)
                if ready is not None:
                    group = self._gather(ready, deferred) if self.batch.enabled else [ready]
                    self._compute(group)
            except Exception as exc:
                log.exception("%s: activation %s failed", self.device_id, act.request_id)
                self._fail(act, f"internal error: {type(exc).__name__}")

    def _take(self, item: Any) -> Activation | None:
        """A queue item as an activation: a sealed frame is opened (and checked) here."""
        if not isinstance(item, _Sealed):
            return item  # type: ignore[no-any-return]
        try:
            return self._open(item.raw)
        except Exception:
            log.exception("%s: opening a frame failed", self.device_id)
            return None

    def _process(self, act: Activation) -> None:
        """Run one activation alone (no batching)."""
        ready = self._prepare(act)
        if ready is not None:
            self._compute([ready])

    def _prepare(self, act: Activation) -> _Ready | None:
        """Checks before compute; a failure is answered here (None)."""
        hop = act.route[act.hop]
        if hop.device_id != self.device_id:
            self._fail(act, f"misrouted: hop {act.hop} is for {hop.device_id}")
            return None
        key = (hop.workload, hop.version, hop.replica, hop.index)
        part = self.get(key)
        if part is None:
            self._fail(act, f"partition {hop.workload} v{hop.version} r{hop.replica} #{hop.index} not deployed")
            return None
        if act.deadline and time.time() > act.deadline:
            # Its client has given up: computing it would only delay the requests queued behind it.
            self.expired += 1
            self._fail(act, "deadline exceeded before compute")
            return None
        if act.hop > 0 and any(k.startswith("\0") for k in act.tensors):
            try:  # the previous hop's output, on the cut's (fog-signed) wire
                act = replace(act, tensors=activations.decode(act.tensors,
                                                              act.route[act.hop - 1].wire))
            except activations.ActivationError as exc:
                part.errors += 1
                self._fail(act, f"bad activation: {exc}")
                return None
        missing = [n for n in part.inputs if n not in act.tensors]
        if missing:
            part.errors += 1
            self._fail(act, f"missing input tensor {missing[0]!r}")
            return None
        return _Ready(act, part, {n: act.tensors[n] for n in part.inputs})

    def _gather(self, first: _Ready, deferred: collections.deque[Any]) -> list[_Ready]:
        """``first`` and the queued frames that can run with it as one batch (``batching``)."""
        part = first.part
        sig = batching.signature(first.feeds, part.inputs) if part.batchable else None
        if sig is None:
            return [first]
        group = [first]
        rows = _rows(first.feeds, part.inputs)
        earliest = first.act.deadline or 0.0
        one_s = part.cost.one_s or part.calib_s
        started = time.monotonic()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                wait = batching.wait_more_s(self.batch, rows, time.monotonic() - started, earliest, time.time(),
                                            one_s, part.cost.slope)
                if wait <= 0:
                    break
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
            if item is _STOP:
                deferred.append(item)
                break
            act = self._take(item)
            if act is None:
                continue
            ready = self._prepare(act)
            if ready is None:
                continue
            if ready.part is not part or batching.signature(ready.feeds, part.inputs) != sig:
                deferred.append(ready.act)  # another partition or shape: after this batch, in order
                continue
            group.append(ready)
            rows += _rows(ready.feeds, part.inputs)
            if ready.act.deadline:
                earliest = min(earliest, ready.act.deadline) if earliest else ready.act.deadline
            if rows >= self.batch.max_batch:
                break
        return group

    def _compute(self, group: list[_Ready]) -> None:
        """Run the group's frames (one batch when more than one) and pass each frame's outputs on."""
        part = group[0].part
        if len(group) == 1:
            feeds = group[0].feeds
        else:
            feeds = {n: np.concatenate([r.feeds[n] for r in group]) for n in part.inputs}
        t0 = time.monotonic()
        try:
            values = part.session.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - bad shapes/dtypes from a peer are its fault
            if len(group) > 1:  # run them one by one: one frame's fault is not the others'
                for r in group:
                    self._compute([r])
                return
            part.errors += 1
            self._fail(group[0].act, f"run failed: {type(exc).__name__}: {str(exc)[:160]}")
            return
        elapsed = time.monotonic() - t0
        target = elapsed * self.slowdown if self.slowdown > 1.0 else elapsed
        if part.sim_artifact:  # dynamic dims: the FLOPs of one sample of these shapes, once
            part.flops, part.sim_artifact = _sample_flops(part.sim_artifact, feeds), b""
        first = feeds[part.inputs[0]] if part.inputs else None
        rows = int(first.shape[0]) if first is not None and first.ndim > 0 else 1
        if self.device_flops and part.flops:  # simulated device: the modelled compute time
            # rows x one sample's time, or less on a device class whose batches cost sublinearly
            target = max(target, batching.batch_cost_s(part.flops / self.device_flops, rows, self.sim_batch_slope))
        if target > elapsed:
            time.sleep(target - elapsed)
            elapsed = target
        if part.calib_on_first:  # the load-time calibration could not: the first request's time
            part.calib_on_first, part.calib_s = False, elapsed
        self.busy_s += elapsed
        part.cost.add(len(group), elapsed)
        if len(group) > 1:
            self.batches += 1
            self.batched_frames += len(group)
        outs = [np.asarray(v) for v in values]
        if len(group) > 1:
            splits = _split(outs, [_rows(r.feeds, part.inputs) for r in group])
            if splits is None:  # an output without the batch axis: cannot say whose it is
                for r in group:
                    self._compute([r])
                return
        else:
            splits = [outs]
        for r, mine in zip(group, splits):
            part.latency.add(elapsed)
            part.served += 1
            self._pass_on(r, dict(zip(part.outputs, mine)), elapsed)

    def _pass_on(self, r: _Ready, outputs: dict[str, Any], elapsed: float) -> None:
        act, part = r.act, r.part
        hop = act.route[act.hop]
        nxt = act.hop + 1
        if nxt < len(act.route):
            # tensors this partition did not consume travel on (a skip connection past this hop)
            passthrough = {k: v for k, v in act.tensors.items() if k not in part.inputs and k not in outputs}
            out = {**passthrough, **outputs}
            next_device = act.route[nxt].device_id
            if hop.wire not in ("", "float32") and next_device != self.device_id:
                out = activations.encode(out, hop.wire)  # compressed across the cut
            fwd = Activation(act.request_id, act.workload, act.route, nxt, act.reply_to,
                             out, act.deadline, act.ticket, act.ticket_sig, act.keys)
            self.forwarded += 1
            if next_device == self.device_id:
                self.submit(fwd)  # next partition is here too: skip the broker round trip
            else:
                with self._seal_lock:  # workers seal concurrently; the sealer's seq is not thread-safe
                    sealed = self._sealer.relay(fwd)
                self._publish(self.topics.activation(next_device, self.device_id), sealed)
            return
        self.answered += 1
        self._reply(act, InferenceResult(act.request_id, True, outputs, "", self.device_id, hop.replica, elapsed))

    def _fail(self, act: Activation, error: str) -> None:
        self.errors_replied += 1
        hop = act.route[act.hop] if 0 <= act.hop < len(act.route) else None
        log.info("%s: request %s failed: %s", self.device_id, act.request_id, error)
        self._reply(act, InferenceResult(act.request_id, False, {}, f"{self.device_id}: {error}",
                                         self.device_id, hop.replica if hop else 0, 0.0))

    def _reply(self, act: Activation, result: InferenceResult) -> None:
        client = reply_client(act.reply_to, self.topics)
        if client is None:
            self.undeliverable += 1
            log.warning("%s: request %s has an unusable reply_to %r", self.device_id, act.request_id,
                        act.reply_to[:80])
            return
        with self._seal_lock:  # workers reply concurrently; the sealer's seq is not thread-safe
            sealed = self._sealer.result(result, time.time())
        self._publish(self.topics.result(client, self.device_id), sealed)  # under our own id (the ACL)


def reply_client(topic: str, topics: Topics) -> str | None:
    """The client a ``reply/{client}`` topic of our own site names (we answer it on
    ``reply/{client}/{us}``); None for any other topic."""
    try:
        parsed = parse(topic)
    except RemoteViolation:
        return None
    if parsed.scope != "reply" or parsed.site != topics.site or parsed.sender:
        return None
    return parsed.name


def valid_reply_topic(topic: str, topics: Topics) -> bool:
    """Replies go only to ``reply/{client}`` topics of our own site (activations are unsigned)."""
    return reply_client(topic, topics) is not None

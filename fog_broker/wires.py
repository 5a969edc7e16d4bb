"""Choosing each cut's activation wire at deploy: the fog runs a calibration batch through the chain.

The fog has every partition of a placed chain (it built them), so it runs them in order on
a calibration batch, in float32, collects the tensors crossing each cut (a partition's outputs
plus what it passes through, as ``edge_agent.executor`` forwards them), and lets
``runtime.activations.choose_wires`` pick the most compact wire per cut within the workload's
accuracy bound; top-1 agreement reruns the chain with the cuts encoded and decoded. Thin
adapter over onnxruntime; the choice itself is pure.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.activations import AccuracyBound, CutChoice, choose_wires, decode, encode

from .site_core import WiresMeasured

__all__ = ["WireReport", "calibrate_chain", "calibration_frames", "calibration_size", "deploy_job"]

log = logging.getLogger(__name__)

_DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64,
           "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
           "tensor(uint8)": np.uint8, "tensor(int8)": np.int8, "tensor(bool)": np.bool_}


@dataclass(frozen=True, slots=True)
class WireReport:
    """The wires chosen for one chain, per cut, with what the calibration measured."""

    cuts: tuple[CutChoice, ...]
    top1: float | None
    frames: int

    @property
    def wires(self) -> tuple[str, ...]:
        """Each partition's output wire (the last partition's answer is float32)."""
        return tuple(c.wire for c in self.cuts) + ("float32",)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cuts": [c.to_dict() for c in self.cuts],
                               "calibration_frames": self.frames,
                               "float32_bytes_per_frame": sum(c.float32_bytes for c in self.cuts),
                               "wire_bytes_per_frame": sum(c.wire_bytes for c in self.cuts)}
        if self.top1 is not None:
            out["top1_agreement"] = self.top1
        return out


def _session(onnx_bytes: bytes) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(onnx_bytes, sess_options=opts,
                                providers=["CPUExecutionProvider"])


def calibration_frames(sessions: Sequence[Any], frames: int, seed: int = 0,
                       shapes: Mapping[str, Sequence[int]] | None = None
                       ) -> list[dict[str, np.ndarray]]:
    """Seeded inputs for every tensor the chain needs from outside (dynamic dims taken as 1)."""
    rng = np.random.default_rng(seed)
    produced: set[str] = set()
    needs: list[tuple[str, list[int], Any]] = []
    for s in sessions:
        for i in s.get_inputs():
            if i.name not in produced and i.name not in {n for n, _, _ in needs}:
                shape = list((shapes or {}).get(i.name, ())) or \
                    [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
                needs.append((i.name, shape, _DTYPES.get(i.type, np.float32)))
        produced.update(o.name for o in s.get_outputs())
    out = []
    for _ in range(frames):
        f = {}
        for name, shape, dt in needs:
            f[name] = (rng.random(shape).astype(dt) if np.dtype(dt).kind == "f"
                       else np.zeros(shape, dt))
        out.append(f)
    return out


def _run(sessions: Sequence[Any], frame: Mapping[str, np.ndarray],
         wires: Sequence[str] | None) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray]]:
    """Tensors crossing each cut (float32 as computed), and the chain's answer."""
    cur = dict(frame)
    cuts: list[dict[str, np.ndarray]] = []
    values: list[np.ndarray] = []
    for k, s in enumerate(sessions):
        ins = [i.name for i in s.get_inputs()]
        outs = [o.name for o in s.get_outputs()]
        values = [np.asarray(v) for v in s.run(None, {n: cur[n] for n in ins})]
        cur = {**{n: v for n, v in cur.items() if n not in ins and n not in outs},
               **dict(zip(outs, values))}
        if k < len(sessions) - 1:
            cuts.append(cur)
            if wires is not None and wires[k] != "float32":
                cur = decode(encode(cur, wires[k]), wires[k], max_elements=2**62)
    return cuts, values


def _top1(answer: Sequence[np.ndarray]) -> int:
    return int(np.argmax(answer[0])) if answer and answer[0].size else 0


#: Calibration frames: 8 for an error bound (it averages over every element of the cut), and for
#: a top-1 bound enough that one changed answer shows (100 for 0.99), within [8, 128].
CALIB_FRAMES, CALIB_FRAMES_MAX = 8, 128


def calibration_size(bound: AccuracyBound) -> int:
    """How many frames tell an agreement of ``bound.min_top1`` from 100 % (pure).

    With 8 frames a 0.99 bound passes an encoding that changes one answer in 60 (seen on
    YOLOv8n with int8 per tensor): every one of the 8 agreed. With ``1 / (1 - min_top1)``
    frames, one changed answer is enough to fall below the bound and step to a tighter wire.
    """
    t = bound.min_top1
    if t is None or not t > 0:
        return CALIB_FRAMES
    need = CALIB_FRAMES_MAX if t >= 1 else math.ceil(1.0 / (1.0 - t) - 1e-9)
    return max(CALIB_FRAMES, min(CALIB_FRAMES_MAX, need))


def calibrate_chain(partitions: Sequence[bytes], bound: AccuracyBound, *,
                    frames: int | None = None, seed: int = 0,
                    batch: Sequence[Mapping[str, np.ndarray]] | None = None,
                    shapes: Mapping[str, Sequence[int]] | None = None) -> WireReport:
    """Choose the wire of every cut of the chain of ``partitions`` (ONNX bytes, in order).

    ``batch``: the calibration frames (default: ``frames`` seeded random inputs, by default as
    many as ``calibration_size`` says the bound needs). Top-1 agreement compares the argmax of
    the chain's first output with every cut encoded against the float32 run, frame by frame.
    """
    sessions = [_session(b) for b in partitions]
    n = calibration_size(bound) if frames is None else frames
    data = list(batch) if batch is not None else calibration_frames(sessions, n, seed, shapes)
    ref = [_run(sessions, f, None) for f in data]
    per_cut = [[r[0][c] for r in ref] for c in range(len(sessions) - 1)]
    want = [_top1(r[1]) for r in ref]

    def top1_of(wires: Sequence[str]) -> float:
        if all(w == "float32" for w in wires):
            return 1.0
        got = [_top1(_run(sessions, f, wires)[1]) for f in data]
        return float(np.mean([a == b for a, b in zip(got, want)])) if data else 1.0

    cuts, top1 = choose_wires(per_cut, bound, top1_of)
    return WireReport(cuts, top1, len(data))


_CACHE: dict[tuple[Any, ...], WireReport] = {}
_CACHE_MAX = 64


def deploy_job(cmd: Any, spec: Any, assignments: Sequence[Any], artifacts: Any,
               put: Callable[[WiresMeasured], None]) -> Callable[[], None] | None:
    """The calibration to run (on the fog's artifact thread) when a chain's first partition deploys.

    None when the workload states no accuracy bound or the chain has no cut. The job reports
    ``("wires", (workload, version, replica), WireReport)`` through ``put``; if the chain cannot
    be calibrated, every cut stays float32 and the report's notes say why.
    """
    bound = AccuracyBound(getattr(spec, "max_activation_error", None),
                          getattr(spec, "min_top1_agreement", None))
    if cmd.index != 0 or not bound.asked or spec.model is None:
        return None
    parts = sorted((a for a in assignments if a.key[1] == cmd.version and a.replica == cmd.replica),
                   key=lambda a: a.index)
    if len(parts) < 2:
        return None
    ranges = tuple((a.first, a.last) for a in parts)
    ref, shapes = spec.model, tuple(spec.input_shapes)
    key = (cmd.workload, cmd.version, cmd.replica)
    ckey = (ref, shapes, ranges, bound)

    def run() -> None:
        rep = _CACHE.get(ckey)
        if rep is None:
            try:
                built = [artifacts.build(ref, first, last, shapes) for first, last in ranges]
                rep = calibrate_chain([b.onnx_bytes for b in built], bound,
                                      shapes=dict(shapes))
            except Exception as exc:  # noqa: BLE001 - calibration is optional: any failure means float32
                log.warning("activation calibration of %s failed: %s", cmd.workload, exc)
                note = f"calibration failed ({type(exc).__name__}); float32"
                rep = WireReport(tuple(CutChoice(c, "float32", 0, 0, 0.0, note)
                                       for c in range(len(ranges) - 1)), None, 0)
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[ckey] = rep
        put(WiresMeasured(key, rep.wires, rep.to_dict()))
    return run

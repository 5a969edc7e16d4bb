"""Compressed activations at the cuts of a partition chain: float32, float16 or int8 on the wire.

A cut's *wire* is how the float32 tensors crossing it travel:

``float32``  unchanged (also ``""``: the default).
``float16``  half precision (values beyond float16's range are clipped to it).
``int8``     ``round(x / s)`` in ``[-127, 127]`` with one float32 scale ``s = max|x| / 127``.
``int8c``    the same with one scale per channel (axis 1 of a tensor with ``ndim >= 2``).

Only float32 tensors are compressed; anything else passes unchanged. An encoded tensor travels
under a reserved name that starts with NUL (``"\\0h\\0x"``: ``x`` as float16; ``"\\0q\\0x"``: ``x``
as int8, with its scales under ``"\\0s\\0x"``), which no graph names, so ``decode`` needs no
side channel and a plain tensor is never mistaken for an encoded one.

``decode`` is bounded like every other decoder: it accepts only the encodings the cut's
(fog-signed) wire allows, checks every scale (float32, finite, > 0, one per tensor or per
channel), refuses name clashes, and refuses to produce more than ``max_elements`` decoded
elements, so a frame within ``codec``'s size limit decodes to at most 4x its bytes. Errors are
``ActivationError`` (a ``DecodeError``) with a one-line reason. Pure: no I/O.

``choose_wires`` picks a wire per cut under an accuracy bound (COST_MODEL: relative L2 error
of the cut's tensors, or top-1 agreement of the model's answer on a calibration batch).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import DecodeError

__all__ = ["WIRES", "ActivationError", "encode", "decode", "wire_bytes", "rel_error",
           "AccuracyBound", "CutChoice", "choose_wires"]

#: Every wire, most compact first (``int8`` before ``int8c``: one scale per tensor is a few bytes
#: fewer; per-channel is the tighter of the two, the step taken when per-tensor misses a bound).
WIRES = ("int8", "int8c", "float16", "float32")
_HALF = "\0h\0"
_QUANT = "\0q\0"
_SCALE = "\0s\0"
_F16_MAX = float(np.finfo(np.float16).max)
#: Decoded elements per activation by default: a 16 MiB frame of int8 is 16 Mi elements.
DEFAULT_MAX_ELEMENTS = 16 * 1024 * 1024


class ActivationError(DecodeError):
    """An encoded activation that does not decode; the message says why in one line."""


def _check_wire(wire: str) -> str:
    w = wire or "float32"
    if w not in WIRES:
        raise ValueError(f"unknown activation wire {wire!r} (one of {', '.join(WIRES)})")
    return w


def _scales(x: np.ndarray, per_channel: bool) -> np.ndarray:
    a = np.abs(x)
    if per_channel and x.ndim >= 2:
        axes = tuple(i for i in range(x.ndim) if i != 1)
        m = a.max(axis=axes) if a.size else np.zeros(x.shape[1], np.float32)
    else:
        m = np.array([a.max() if a.size else 0.0])
    m = m.astype(np.float32)
    s = m / np.float32(127.0)
    s[~(s > 0)] = 1.0  # an all-zero channel (or a non-finite max): any scale decodes it exactly
    return np.where(np.isfinite(s), s, np.float32(1.0)).astype(np.float32)


def _bshape(x_ndim: int, scales: np.ndarray) -> tuple[int, ...]:
    """The shape that broadcasts per-channel scales along axis 1 (per-tensor: as is)."""
    if scales.shape[0] == 1:
        return (1,)
    return (1, scales.shape[0]) + (1,) * (x_ndim - 2)


def encode(tensors: Mapping[str, np.ndarray], wire: str) -> dict[str, np.ndarray]:
    """``tensors`` as they cross a cut of ``wire``; the identity for ``float32``."""
    w = _check_wire(wire)
    if w == "float32":
        return dict(tensors)
    out: dict[str, np.ndarray] = {}
    for name, x in tensors.items():
        x = np.asarray(x)
        if x.dtype != np.float32 or name.startswith("\0"):
            out[name] = x
        elif w == "float16":
            out[_HALF + name] = np.clip(x, -_F16_MAX, _F16_MAX).astype(np.float16)
        else:
            s = _scales(x, w == "int8c")
            xs = x / s.reshape(_bshape(x.ndim, s)) if x.ndim else x / s[0]
            q = np.clip(np.rint(np.nan_to_num(xs, nan=0.0)), -127, 127).astype(np.int8)
            out[_QUANT + name] = q
            out[_SCALE + name] = s
    return out


def decode(tensors: Mapping[str, np.ndarray], wire: str, *,
           max_elements: int = DEFAULT_MAX_ELEMENTS) -> dict[str, np.ndarray]:
    """The float32 tensors behind an encoded activation that crossed a cut of ``wire``.

    Plain tensors pass unchanged (a cut inside one device is not encoded); an encoding other
    than the cut's, a missing or malformed scale, a clash or too many elements raise
    ``ActivationError``.
    """
    try:
        w = _check_wire(wire)
    except ValueError as exc:
        raise ActivationError(str(exc)) from None
    out: dict[str, np.ndarray] = {}
    made = 0
    scales = {k[len(_SCALE):]: v for k, v in tensors.items() if k.startswith(_SCALE)}
    used_scales = 0
    for key, x in tensors.items():
        if not key.startswith("\0"):
            name, value = key, x
        elif key.startswith(_SCALE):
            continue
        elif key.startswith(_HALF):
            name = key[len(_HALF):]
            if w != "float16":
                raise ActivationError(f"tensor {name!r}: float16 on a {w} cut")
            if x.dtype != np.float16:
                raise ActivationError(f"tensor {name!r}: float16 expected, got {x.dtype}")
            made += x.size
            if made > max_elements:
                raise ActivationError(f"more than {max_elements} decoded elements")
            value = x.astype(np.float32)
        elif key.startswith(_QUANT):
            name = key[len(_QUANT):]
            if w not in ("int8", "int8c"):
                raise ActivationError(f"tensor {name!r}: int8 on a {w} cut")
            if x.dtype != np.int8:
                raise ActivationError(f"tensor {name!r}: int8 expected, got {x.dtype}")
            s = scales.get(name)
            if s is None:
                raise ActivationError(f"tensor {name!r}: int8 without its scale")
            used_scales += 1
            channels = x.shape[1] if x.ndim >= 2 else 1
            if s.dtype != np.float32 or s.ndim != 1 or s.shape[0] not in (1, channels):
                raise ActivationError(f"tensor {name!r}: scale must be float32 of shape (1,) "
                                      f"or ({channels},), got {s.dtype} {s.shape}")
            if s.shape[0] != 1 and w != "int8c":
                raise ActivationError(f"tensor {name!r}: per-channel scale on an int8 cut")
            if not bool(np.all(np.isfinite(s) & (s > 0))):
                raise ActivationError(f"tensor {name!r}: scale not finite and > 0")
            made += x.size
            if made > max_elements:
                raise ActivationError(f"more than {max_elements} decoded elements")
            value = x.astype(np.float32) * (s.reshape(_bshape(x.ndim, s)) if x.ndim else s[0])
            value = np.asarray(value, dtype=np.float32)
        else:
            raise ActivationError(f"unknown encoded tensor {key[:40]!r}")
        if name in out:
            raise ActivationError(f"tensor {name!r} twice")
        out[name] = value
    if used_scales != len(scales):
        raise ActivationError("a scale without its int8 tensor")
    return out


def wire_bytes(tensors: Mapping[str, np.ndarray]) -> int:
    """Array bytes of an (encoded) activation: what the cut carries, framing aside."""
    return int(sum(np.asarray(v).nbytes for v in tensors.values()))


def rel_error(tensors: Mapping[str, np.ndarray], wire: str) -> float:
    """Relative L2 error ``||decode(encode(x)) - x|| / ||x||`` over the float32 tensors."""
    back = decode(encode(tensors, wire), wire, max_elements=2**62)
    num = den = 0.0
    for name, x in tensors.items():
        x = np.asarray(x)
        if x.dtype != np.float32:
            continue
        d = back[name].astype(np.float64) - x
        num += float(np.sum(d * d))
        den += float(np.sum(x.astype(np.float64) ** 2))
    return 0.0 if num == 0 else (float(np.sqrt(num / den)) if den > 0 else float("inf"))


@dataclass(frozen=True, slots=True)
class AccuracyBound:
    """What a workload tolerates at its cuts: either bound, or both (None: not asked)."""

    max_rel_error: float | None = None
    min_top1: float | None = None

    @property
    def asked(self) -> bool:
        return self.max_rel_error is not None or self.min_top1 is not None


@dataclass(frozen=True, slots=True)
class CutChoice:
    """The wire chosen for one cut and what was measured on the calibration batch."""

    cut: int                  # after partition ``cut`` (0-based)
    wire: str
    float32_bytes: int        # per frame
    wire_bytes: int           # per frame, on the chosen wire
    rel_error: float          # of the cut's tensors on the chosen wire
    note: str = ""            # why float32 when an encoding was asked for

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"cut": self.cut, "wire": self.wire,
                                  "float32_bytes": self.float32_bytes,
                                  "wire_bytes": self.wire_bytes,
                                  "bytes_saved": self.float32_bytes - self.wire_bytes,
                                  "rel_error": self.rel_error}
        if self.note:
            out["note"] = self.note
        return out


def _bytes_per_frame(batch: Sequence[Mapping[str, np.ndarray]], wire: str) -> int:
    return wire_bytes(encode(batch[0], wire)) if batch else 0


def choose_wires(cuts: Sequence[Sequence[Mapping[str, np.ndarray]]], bound: AccuracyBound,
                 top1_of: Callable[[Sequence[str]], float] | None = None,
                 candidates: Sequence[str] = WIRES[:-1]
                 ) -> tuple[tuple[CutChoice, ...], float | None]:
    """A wire per cut, the most compact that keeps ``bound``; and the top-1 agreement reached.

    ``cuts[c]`` holds the float32 tensors crossing cut ``c`` for each calibration frame (the
    model run whole, in float32). ``max_rel_error`` bounds each cut's relative L2 error;
    ``min_top1`` bounds ``top1_of(wires)``: the fraction of calibration frames whose answer's
    argmax is unchanged with every cut on those wires. Each cut first takes the most compact
    candidate that meets the bound alone; while the cuts together miss ``min_top1``, the cut
    with the largest error steps to the next wire. A cut no encoding suits stays float32 with a
    note saying so. No bound asked: every cut float32.
    """
    n = len(cuts)
    errs: list[dict[str, float]] = [
        {w: float(np.mean([rel_error(f, w) for f in frames])) if frames else 0.0
         for w in candidates} for frames in cuts]
    f32 = [_bytes_per_frame(frames, "float32") for frames in cuts]
    if not bound.asked:
        return tuple(CutChoice(c, "float32", f32[c], f32[c], 0.0) for c in range(n)), None
    chosen = ["float32"] * n
    notes = [""] * n
    base = ["float32"] * n
    for c in range(n):
        for w in candidates:
            if bound.max_rel_error is not None and errs[c][w] > bound.max_rel_error:
                continue
            if bound.min_top1 is not None and top1_of is not None:
                trial = list(base)
                trial[c] = w
                if top1_of(trial) < bound.min_top1:
                    continue
            chosen[c] = w
            break
        else:
            best = min(candidates, key=lambda w: errs[c][w]) if candidates else "float32"
            notes[c] = (f"no encoding meets the accuracy bound (best {best}: relative error "
                        f"{errs[c].get(best, 0.0):.3g}); float32")
    top1 = None
    if bound.min_top1 is not None and top1_of is not None:
        top1 = top1_of(chosen)
        order = list(candidates) + ["float32"]
        while top1 < bound.min_top1 and any(w != "float32" for w in chosen):
            c = max((i for i in range(n) if chosen[i] != "float32"),
                    key=lambda i: errs[i][chosen[i]])
            chosen[c] = order[order.index(chosen[c]) + 1]
            if chosen[c] == "float32":
                notes[c] = "together the cuts missed the top-1 bound; float32"
            top1 = top1_of(chosen)
    out = []
    for c in range(n):
        w = chosen[c]
        out.append(CutChoice(c, w, f32[c], _bytes_per_frame(cuts[c], w),
                             0.0 if w == "float32" else errs[c][w], notes[c]))
    return tuple(out), top1

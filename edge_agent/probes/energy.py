"""Joules per inference, measured from the board's rails or modelled (pure).

Where the board has a meter, the agent runs a batch of inferences of a partition it just
loaded and reads the meter around it: an energy counter (Intel RAPL) is read before and
after; a power rail (Jetson INA3221, Raspberry Pi 5 PMIC, a UPS HAT's INA219, a laptop
battery while it discharges) is sampled during the batch and integrated. The figure is the
whole board's energy over the batch divided by the batch: what running the partition costs
the device, idle draw included. Without a meter the figure is modelled as
``power_active_w x seconds per inference`` (COST_MODEL.md) and says so (``measured=False``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EnergyFigure", "SOURCES", "batch_size", "from_counter", "from_power", "modelled"]

# Where a measured figure came from; "model" is the COST_MODEL.md estimate.
SOURCES = ("rapl", "ina3221", "pmic", "ina219", "battery", "model")

_TARGET_S = 1.0  # a batch long enough for slow meters (INA3221 averages over ~10-100 ms)
_MIN_N, _MAX_N = 5, 1000


@dataclass(frozen=True, slots=True)
class EnergyFigure:
    joules_per_inference: float
    measured: bool
    source: str  # one of SOURCES

    def __post_init__(self) -> None:
        j = self.joules_per_inference
        if not (j >= 0.0 and math.isfinite(j)):
            raise ValueError(f"joules per inference must be finite and >= 0, got {j!r}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown energy source {self.source!r}")


def batch_size(seconds_per_inference: float, target_s: float = _TARGET_S) -> int:
    """Inferences in a measuring batch: about ``target_s`` of work, within [5, 1000]."""
    if not seconds_per_inference > 0 or not math.isfinite(seconds_per_inference):
        return _MIN_N
    return max(_MIN_N, min(_MAX_N, math.ceil(target_s / seconds_per_inference)))


def from_counter(delta_uj: int, n: int, source: str = "rapl") -> EnergyFigure | None:
    """An energy counter's increase over a batch of ``n``; None when it did not move."""
    if n < 1 or delta_uj <= 0:
        return None  # a counter that did not tick (too coarse, or not updating) measures nothing
    return EnergyFigure(delta_uj / 1e6 / n, True, source)


def from_power(samples_w: Sequence[float], elapsed_s: float, n: int, source: str) -> EnergyFigure | None:
    """Mean sampled power x batch time / ``n``; None without a usable sample."""
    good = [w for w in samples_w if w >= 0.0 and math.isfinite(w)]
    if n < 1 or not good or not elapsed_s > 0 or not math.isfinite(elapsed_s):
        return None
    return EnergyFigure(sum(good) / len(good) * elapsed_s / n, True, source)


def modelled(power_active_w: float, seconds_per_inference: float) -> EnergyFigure:
    """The COST_MODEL.md figure for a device without a meter."""
    j = max(0.0, power_active_w) * max(0.0, seconds_per_inference)
    return EnergyFigure(j if math.isfinite(j) else 0.0, False, "model")

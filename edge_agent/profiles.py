"""Device profiles: the COST_MODEL.md device fields of typical edge machines.

One table shared by the simulated edge agent (``fogline agent --simulate``), the live probe (a
known board's link and power figures) and the simulations package, which imports it from here:
devices do not import the simulator. Figures are effective onnxruntime FP32 throughput and
measured-order power draws, not datasheet peaks; they are meant to make placements plausible,
not to benchmark hardware.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from runtime._schema import schema_of
from runtime.devices import RESOURCE_RANGES, DeviceResources

__all__ = ["DeviceProfile", "PROFILES", "get_profile"]

_GB = 1_000_000_000


@dataclass(frozen=True)
class _Named:
    __slots__ = ()
    name: str


@dataclass(frozen=True, slots=True)
class DeviceProfile(DeviceResources, _Named):
    """A device model: the one device record (``runtime.devices.DeviceResources``, its ranges
    checked at construction) with a name, an initial battery level and the physical memory."""

    cpu_count: int = 4
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    battery_level: float = 1.0  # initial level (0..1) when battery powered
    total_memory_bytes: int = 0  # physical memory (0: same as memory_bytes)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", dict(self.labels))
        try:
            DeviceResources.__post_init__(self)
        except ValueError as e:
            raise ValueError(f"profile {self.name}: {e}") from None
        if not 0.0 <= self.battery_level <= 1.0:
            raise ValueError(f"profile {self.name}: battery_level must be in [0, 1]")
        object.__setattr__(self, "labels", MappingProxyType(self.labels))

    def to_fleet_device(self, device_id: str, *, alive: bool = True,
                        labels: Mapping[str, str] | None = None,
                        taints: tuple[Mapping[str, str], ...] = ()) -> dict[str, Any]:
        """A device entry of COST_MODEL.md's FLEET.json."""
        battery = None
        if self.battery_capacity_wh is not None:
            battery = {"capacity_wh": self.battery_capacity_wh, "level": self.battery_level}
        figures = {n: getattr(self, n) for n in RESOURCE_RANGES if n != "battery_capacity_wh"}
        return {"id": device_id, "labels": {**self.labels, **(labels or {})},
                "taints": [dict(t) for t in taints], **figures, "battery": battery, "alive": alive}


schema_of(DeviceProfile)


# Radio / NIC energy per byte: Wi-Fi ~ 20-100 nJ/bit, wired Ethernet ~ 5 nJ/bit.
_WIFI_J_PER_BYTE = 4e-7
_ETH_J_PER_BYTE = 4e-8

_CUDA_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def _profile(name: str, arch: str, j_per_byte: float, *, link_bps: float, cuda: bool = False,
             **figures: Any) -> DeviceProfile:
    """A device model: its link is symmetric, its labels say its arch, accelerator and model
    (``name``), and a CUDA board also offers TensorRT and CUDA to onnxruntime."""
    gpu: dict[str, Any] = {"accelerators": ("cuda",), "providers": _CUDA_PROVIDERS} if cuda else {}
    labels = {"arch": arch, "accelerator": "cuda" if cuda else "none", "device-model": name}
    return DeviceProfile(name, uplink_bps=link_bps, downlink_bps=link_bps, tx_j_per_byte=j_per_byte,
                         rx_j_per_byte=j_per_byte, labels=labels, **gpu, **figures)


PROFILES: dict[str, DeviceProfile] = {
    p.name: p for p in (
        _profile("pi4", "arm64", _ETH_J_PER_BYTE, flops=6e9, memory_bytes=3 * _GB, total_memory_bytes=4 * _GB,
                 link_bps=300e6, rtt_s=0.002, power_active_w=6.4, power_idle_w=2.7, cpu_count=4),
        _profile("pi5", "arm64", _ETH_J_PER_BYTE, flops=20e9, memory_bytes=7 * _GB, total_memory_bytes=8 * _GB,
                 link_bps=900e6, rtt_s=0.001, power_active_w=8.0, power_idle_w=2.9, cpu_count=4),
        _profile("orin-nano", "arm64", _ETH_J_PER_BYTE, cuda=True, flops=400e9, memory_bytes=6 * _GB,
                 total_memory_bytes=8 * _GB, link_bps=900e6, rtt_s=0.001, power_active_w=15.0,
                 power_idle_w=5.0, cpu_count=6),
        _profile("jetson-nano", "arm64", _ETH_J_PER_BYTE, cuda=True, flops=60e9, memory_bytes=3 * _GB,
                 total_memory_bytes=4 * _GB, link_bps=900e6, rtt_s=0.001, power_active_w=10.0,
                 power_idle_w=1.5, cpu_count=4),
        _profile("x86-gateway", "amd64", _ETH_J_PER_BYTE, flops=80e9, memory_bytes=14 * _GB,
                 total_memory_bytes=16 * _GB, link_bps=1e9, rtt_s=0.0005, power_active_w=25.0,
                 power_idle_w=6.0, cpu_count=4),
        _profile("camera", "arm", _WIFI_J_PER_BYTE, flops=1e9, memory_bytes=200_000_000,
                 total_memory_bytes=512_000_000, link_bps=20e6, rtt_s=0.005, power_active_w=2.5,
                 power_idle_w=1.2, battery_capacity_wh=20.0, cpu_count=2),
        _profile("laptop", "amd64", _WIFI_J_PER_BYTE, flops=150e9, memory_bytes=12 * _GB,
                 total_memory_bytes=16 * _GB, link_bps=300e6, rtt_s=0.003, power_active_w=35.0,
                 power_idle_w=8.0, battery_capacity_wh=55.0, cpu_count=8),
    )
}


def get_profile(name: str) -> DeviceProfile:
    """The profile called ``name``; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown device profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None

"""Energy benchmark: the energy objective's plan against the latency objective's, on measured rails.

Run: ``fogline bench energy [--quick]`` (or ``python -m benchmarks.energy_bench``). Prints JSON,
writes ``out/bench/energy.json``, and a summary on stderr. All figures come from one run.

A simulated site (a camera board as source and sink, Raspberry Pi 5s, Jetson Orin Nanos, x86
laptops, a mains gateway) where each board's active draw is what its meter reads during a
batch, as the agent measures it (``edge_agent.probes.energy``): the Pi 5's PMIC, the Orin's
INA3221 ``VDD_IN``, the laptop's RAPL ``psys``; the gateway has no meter, so its figure stays
the modelled one. Its declared (profile) draw differs from the measured one as datasheets do.

For every workload the scheduler plans twice on the measured fleet, once per objective, and
once with the energy objective on the declared (modelled) fleet. Every plan is then costed on
the measured fleet (COST_MODEL.md: compute energy = active draw x compute time; the measured
draw is the metered joules per inference over the measured seconds per inference), so the
table answers: how many joules per inference the energy objective saves against the latency
objective, at what latency, and what planning on declared instead of measured figures costs.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from benchmarks._emit import quick_main
from edge_agent.probes import energy
from fog_broker.placement import (
    ChainProfile,
    Device,
    Fleet,
    Segment,
    Workload,
    chain_cost,
    schedule,
)

#: name, flops, memory, uplink, downlink, rtt, declared active W, metered active W (None: no meter),
#: meter. Metered draws are whole-board figures under an onnxruntime load (order of published
#: measurements); declared are the profiles' figures, which overstate the Pi and the laptop and
#: understate the Orin in its 15 W mode.
TYPES = [
    ("cam", 1e9, 2e8, 2e7, 2e7, 8e-3, 2.0, 2.4, "ina219"),
    ("pi5", 1.5e10, 3e9, 1e8, 1e8, 3e-3, 8.0, 6.2, "pmic"),
    ("orin", 4e10, 6e9, 3e8, 3e8, 2e-3, 10.0, 13.5, "ina3221"),
    ("laptop", 5e10, 8e9, 2e8, 4e8, 5e-3, 30.0, 19.0, "rapl"),
    ("gateway", 3e10, 8e9, 9e8, 9e8, 1e-3, 25.0, None, "model"),
]


def measured_power_w(rail_w: float, seconds: float, n: int, rng: random.Random, source: str) -> float:
    """The active draw the fog derives from one metered batch: joules per inference / seconds.

    The meter's samples carry its noise (+-3 %); the batch size is the agent's own choice.
    """
    samples = [rail_w * rng.uniform(0.97, 1.03) for _ in range(max(2, int(seconds * n / 0.05)))]
    fig = energy.from_power(samples, seconds * n, n, source)
    assert fig is not None and fig.measured
    return fig.joules_per_inference / seconds


def make_site(rng: random.Random, n: int) -> tuple[Fleet, Fleet, dict[str, str]]:
    """(declared fleet, measured fleet, device -> meter); device 0 is the camera."""
    kinds = [TYPES[0]] + [rng.choice(TYPES[1:]) for _ in range(n - 1)]
    declared, measured, meters = [], [], {}

    def j() -> float:
        return rng.uniform(0.85, 1.2)
    for i, (name, fl, mem, up, down, rtt, pw, rail, meter) in enumerate(kinds):
        d = Device(id=f"{name}-{i}", flops=fl * j(), memory_bytes=int(mem * j()), uplink_bps=up * j(),
                   downlink_bps=down * j(), rtt_s=rtt * j(), power_active_w=pw, power_idle_w=0.0,
                   tx_j_per_byte=5e-8 * j(), rx_j_per_byte=5e-8 * j(),
                   labels={"power-domain": f"pd{i}", "device-model": name})
        declared.append(d)
        if rail is None:
            measured.append(d)  # no meter: the modelled figure, marked as such
        else:
            seconds = 1e9 / d.flops  # a 1 GFLOP calibration partition on this board
            n_batch = energy.batch_size(seconds)
            measured.append(replace(d, power_active_w=measured_power_w(rail * j(), seconds, n_batch,
                                                                       rng, meter)))
        meters[d.id] = meter
    return Fleet(tuple(declared)), Fleet(tuple(measured)), meters


def make_profile(rng: random.Random, n: int) -> ChainProfile:
    segs = tuple(Segment(f"s{i}", rng.uniform(2e8, 3e9), rng.uniform(2e6, 1.2e8),
                         rng.uniform(1e6, 3e7), rng.uniform(2e4, 6e5)) for i in range(n))
    return ChainProfile("m", 150_528.0, segs)


def _plan(fleet: Fleet, w: Workload) -> Any:
    res = schedule(fleet, [w]).workloads[0]
    return res.replicas[0].partitions if res.placed else None


def run(quick: bool) -> dict[str, Any]:
    rng = random.Random(20261127)
    sites = 8 if quick else 40
    rows: list[dict[str, Any]] = []
    metered = modelled = 0
    for k in range(sites):
        declared, measured, meters = make_site(rng, rng.randint(5, 10))
        metered += sum(1 for m in meters.values() if m != "model")
        modelled += sum(1 for m in meters.values() if m == "model")
        truth = {d.id: d for d in measured.devices}
        cam = measured.devices[0].id
        for _ in range(3):
            prof = make_profile(rng, rng.randint(4, 12))
            base = Workload(name=f"w{k}", source=cam, sink=cam, profile=prof)
            plans = {
                "latency": _plan(measured, replace(base, objective="latency")),
                "energy": _plan(measured, replace(base, objective="energy")),
                "energy_declared": _plan(declared, replace(base, objective="energy")),
            }
            if any(p is None for p in plans.values()):
                continue
            row: dict[str, Any] = {}
            for name, parts in plans.items():
                c = chain_cost(prof, parts, truth, cam, cam)  # costed on the measured figures
                row[name] = {"latency_s": c.latency_s, "energy_j": c.energy_j,
                             "devices": sorted({p.device.split("-")[0] for p in parts})}
            rows.append(row)

    def stat(plan: str, key: str) -> dict[str, float]:
        xs = [r[plan][key] for r in rows]
        return {"mean": statistics.fmean(xs), "median": statistics.median(xs)}

    def ratio(a: str, b: str, key: str) -> float:
        return float(statistics.median([r[a][key] / r[b][key] for r in rows if r[b][key] > 0]))

    return {
        "quick": quick, "sites": sites, "workloads": len(rows),
        "devices_metered": metered, "devices_modelled": modelled,
        "plans": {p: {"joules_per_inference": stat(p, "energy_j"), "latency_s": stat(p, "latency_s")}
                  for p in ("latency", "energy", "energy_declared")},
        # per workload, energy plan / latency plan (median over workloads)
        "energy_vs_latency": {"joules_ratio": ratio("energy", "latency", "energy_j"),
                              "latency_ratio": ratio("energy", "latency", "latency_s")},
        # planning the energy objective on declared draws instead of measured ones
        "declared_vs_measured": {"joules_ratio": ratio("energy_declared", "energy", "energy_j"),
                                 "joules_ratio_worst": max(r["energy_declared"]["energy_j"] / r["energy"]["energy_j"]
                                                           for r in rows),
                                 "joules_total_ratio": sum(r["energy_declared"]["energy_j"] for r in rows)
                                 / sum(r["energy"]["energy_j"] for r in rows),
                                 "workloads_worse": sum(1 for r in rows if r["energy_declared"]["energy_j"]
                                                        > r["energy"]["energy_j"] * (1 + 1e-9))},
        "device_types": {p: sum(1 for r in rows if p in r["energy"]["devices"]) for p, *_ in TYPES},
        "device_types_latency_plan": {p: sum(1 for r in rows if p in r["latency"]["devices"])
                                      for p, *_ in TYPES},
    }


def summary(r: dict[str, Any]) -> str:
    p = r["plans"]
    return (f"energy bench: {r['workloads']} workloads on {r['sites']} sites "
            f"({r['devices_metered']} metered devices, {r['devices_modelled']} modelled)\n"
            f"  latency objective: {p['latency']['joules_per_inference']['median']:.3f} J, "
            f"{p['latency']['latency_s']['median'] * 1e3:.1f} ms (medians)\n"
            f"  energy objective:  {p['energy']['joules_per_inference']['median']:.3f} J, "
            f"{p['energy']['latency_s']['median'] * 1e3:.1f} ms\n"
            f"  energy/latency plan: x{r['energy_vs_latency']['joules_ratio']:.2f} joules, "
            f"x{r['energy_vs_latency']['latency_ratio']:.2f} latency (median per workload)\n"
            f"  energy plan on declared draws: x{r['declared_vs_measured']['joules_ratio']:.2f} joules, "
            f"worse on {r['declared_vs_measured']['workloads_worse']} workloads "
            f"(x{r['declared_vs_measured']['joules_total_ratio']:.3f} in total, "
            f"x{r['declared_vs_measured']['joules_ratio_worst']:.2f} at worst)")


def main(argv: Sequence[str] | None = None) -> int:
    return quick_main("energy", run, summary, argv, description=__doc__, quick_help="smaller run (a few seconds)")


if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-site benchmark: 100 sites x 1,000 devices on the discrete-event engine under one coordinator.

Run: ``python -m benchmarks.sites_bench [--quick] [--sites N] [--duration S]``. Prints JSON on stdout
(the per-site rows and the rollout timeline are only in the file), writes ``out/bench/sites.json``,
a human summary on stderr.

* baseline: one site of the same scenario (``hundred-sites``: 1,000 devices, its workloads and churn)
  on a plain ``FleetSim``, no coordinator, measured first in this process;
* fleet: every site of the scenario as its own ``FleetSim`` under the simulated coordinator (status
  polls, summaries over WAN links that are cut and restored, the staged release driven by the real
  ``RolloutBook``). Reported: wall time, events/s, peak RSS, placements and repairs per site, the
  rollout (canary, then every site: when each accepted and switched), summaries queued and drained.

Ratios: the fleet's CPU time per site over the baseline's (the coordinator's overhead and any
super-linear cost show up here; CPU rather than wall time, as the machine may be shared), the same
with wall time, and events per CPU second of the fleet over the baseline's.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any

from benchmarks._emit import report, run_header


def _log(msg: str) -> None:
    print(f"[sites {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rss_mb() -> float:
    """Current resident set (MB), from /proc (the peak is ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_baseline(scenario: Any, duration_s: float) -> dict[str, Any]:
    from simulations.multisite import build_site

    rss0 = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    site = build_site(scenario, 0, "site-000", clock=time.perf_counter, duration_s=duration_s)
    r = site.sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0  # building the fleet included
    return {"devices": len(site.sim.devices), "workloads": len(site.specs), "sim_hours": round(r.sim_s / 3600, 3),
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "events": r.events,
            "events_per_wall_s": round(r.events / wall, 1), "events_per_cpu_s": round(r.events / cpu, 1),
            "adverts": r.adverts, "crashes": r.crashes, "placements": r.counters["deploys"],
            "repairs": r.counters["repairs"], "rss_growth_mb": round(_rss_mb() - rss0, 1)}


def bench_sites(scenario: Any, sites: int, duration_s: float) -> dict[str, Any]:
    from simulations.multisite import run_multisite

    rss0 = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    r = run_multisite(scenario, clock=time.perf_counter, duration_s=duration_s, sites=sites)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = r.summary()
    s["wall_s_with_build"], s["cpu_s_with_build"] = round(wall, 3), round(cpu, 3)
    s["rss_growth_mb"] = round(_rss_mb() - rss0, 1)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sites_bench", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="10 sites, 30 simulated minutes")
    ap.add_argument("--sites", type=int, default=None, help="number of sites (default 100)")
    ap.add_argument("--duration", type=float, default=None, help="simulated seconds (default the scenario's)")
    ap.add_argument("--scenario", default="hundred-sites")
    args = ap.parse_args(argv)
    from simulations.scenario import load_scenario

    sc = load_scenario(args.scenario)
    sites = args.sites or (10 if args.quick else int(sc.sites.get("count", 100)))
    duration = args.duration or (1800.0 if args.quick else sc.duration_s)
    out = run_header("sites", args.quick, scenario=sc.name)
    t0 = time.monotonic()
    _log(f"baseline: one site of {sc.name}, {sc.devices} devices, {duration / 60:g} simulated minutes")
    base = bench_baseline(sc, duration)
    _log(f"baseline: {base['wall_s']} s, {base['events_per_wall_s']} events/s")
    _log(f"fleet: {sites} sites x {sc.devices} devices, {duration / 60:g} simulated minutes")
    fleet = bench_sites(sc, sites, duration)
    out["baseline_single_site"] = base
    out["fleet"] = fleet
    # CPU time is the figure to compare on a shared machine (wall time also counts other work)
    per_site = fleet["cpu_s_with_build"] / sites
    out["per_site_cpu_s"] = round(per_site, 3)
    out["per_site_cost_ratio"] = round(per_site / base["cpu_s"], 2) if base["cpu_s"] else None
    out["per_site_wall_ratio"] = (round(fleet["wall_s_with_build"] / sites / base["wall_s"], 2)
                                  if base["wall_s"] else None)
    out["events_per_cpu_s_ratio"] = round(fleet["events_per_cpu_s"] / base["events_per_cpu_s"], 2) \
        if base["events_per_cpu_s"] else None
    out["peak_rss_mb"] = round(_peak_mb(), 1)
    out["rss_per_device_kb"] = round(fleet["rss_growth_mb"] * 1024 / fleet["devices"], 2) if fleet["devices"] else None
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    out["bench_wall_s"] = round(time.monotonic() - t0, 1)
    brief = {**out, "fleet": {k: v for k, v in fleet.items() if k != "per_site"}}
    if brief["fleet"].get("rollout"):
        brief["fleet"]["rollout"] = {k: v for k, v in fleet["rollout"].items() if k != "timeline"}
    return report("sites", out, _human, stdout=brief)


def _human(out: dict[str, Any]) -> str:
    b, f = out["baseline_single_site"], out["fleet"]
    ro = f.get("rollout") or {}
    sm = f["summaries"]
    lines = [
        (f"baseline, one site of {b['devices']} devices: {b['sim_hours']} sim h in {b['wall_s']} s wall, "
         f"{b['cpu_s']} s CPU ({b['events_per_cpu_s']} events/CPU s), {b['placements']} placements, "
         f"{b['repairs']} repairs"),
        (f"{f['sites']} sites x {f['devices_per_site']} devices = {f['devices']}: {f['sim_hours']} sim h in "
         f"{f['wall_s']} s wall, {f['cpu_s']} s CPU ({f['events_per_cpu_s']} events/CPU s, {f['adverts']} adverts), "
         f"peak RSS {out['peak_rss_mb']} MB (+{f['rss_growth_mb']} MB, {out['rss_per_device_kb']} kB/device)"),
        (f"per site {out['per_site_cpu_s']} s CPU = x{out['per_site_cost_ratio']} the single site "
         f"(wall x{out['per_site_wall_ratio']}); events per CPU s x{out['events_per_cpu_s_ratio']}"),
        (f"placements per site p50 {f['placements_per_site'].get('p50')}, repairs per site p50 "
         f"{f['repairs_per_site'].get('p50')} max {f['repairs_per_site'].get('max')}; summaries {sm.get('sent')} sent, "
         f"{sm.get('queued')} queued while cut, {sm.get('drained')} drained"),
    ]
    if ro:
        lines.append(f"rollout {ro['release']}: {ro['step']} at {ro.get('finished_at_s')} s (released at "
                     f"{ro.get('released_at_s')} s), {ro.get('sites_accepted')} sites accepted, "
                     f"{ro.get('sites_switched')} switched (last {ro.get('last_switched_s')} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

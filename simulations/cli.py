"""``fogline simulate`` (discrete-event fleets) and ``fogline demo`` (real processes)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _simulate(args: argparse.Namespace) -> int:
    import time

    from .des import run_scenario
    from .scenario import load_scenario

    scenario = load_scenario(args.scenario)
    if scenario.sites or args.sites:
        return _simulate_sites(args, scenario)
    print(f"simulating {scenario.name}: {scenario.devices} devices, {len(scenario.workloads)} workloads, "
          f"{(args.duration or scenario.duration_s) / 3600:.2f} simulated hours ...", file=sys.stderr)
    result = run_scenario(scenario, clock=time.perf_counter, duration_s=args.duration)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    avail = summary["availability"]
    print(f"{summary['sim_hours']} simulated hours in {summary['wall_s']} s "
          f"({summary['sim_hours_per_wall_s']} sim h / wall s), {summary['events']} events, "
          f"{summary['adverts']} adverts")
    print(f"crashes {summary['crashes']}, re-placements {summary['counters']['repairs']}, "
          f"recovery after detection p50 {summary['recovery_p50_s']} s / p99 {summary['recovery_p99_s']} s")
    print(f"placement: {summary['schedule_calls']} solves, p50 {summary['schedule_p50_ms']:.1f} ms, "
          f"p99 {summary['schedule_p99_ms']:.1f} ms")
    if avail:
        worst = min(avail.items(), key=lambda kv: kv[1])
        print(f"availability: mean {sum(avail.values()) / len(avail):.4%}, worst {worst[0]} {worst[1]:.4%}")
    return 0


def _simulate_sites(args: argparse.Namespace, scenario: Any) -> int:
    import time

    from .multisite import run_multisite

    n = args.sites or scenario.sites.get("count")
    print(f"simulating {scenario.name}: {n} sites x {scenario.devices} devices, {len(scenario.workloads)} workloads "
          f"per site, {(args.duration or scenario.duration_s) / 3600:.2f} simulated hours ...", file=sys.stderr)
    result = run_multisite(scenario, clock=time.perf_counter, duration_s=args.duration, sites=args.sites)
    s = result.summary()
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    pl, rp, sm = s["placements_per_site"], s["repairs_per_site"], s["summaries"]
    print(f"{s['sites']} sites, {s['devices']} devices: {s['sim_hours']} simulated hours in {s['wall_s']} s "
          f"({s['cpu_s']} s CPU), {s['events']} events ({s['events_per_wall_s']}/s), {s['adverts']} adverts, "
          f"peak RSS {s['peak_rss_mb']} MB")
    print(f"crashes {s['crashes']}; placements per site p50 {pl.get('p50')} (max {pl.get('max')}), repairs per site "
          f"p50 {rp.get('p50')} (max {rp.get('max')}, total {rp.get('total')}); workloads running "
          f"{s['workloads_running']}/{s['workloads']}")
    print(f"summaries: {sm.get('sent', 0)} sent, {sm.get('queued', 0)} queued while cut, {sm.get('drained', 0)} "
          f"drained on restore, {sm.get('waiting', 0)} still waiting")
    for c in s["cuts"]:
        if c["restored_at_s"] is None:
            print(f"  {c['site']} cut at {c['cut_at_s']:g} s, still cut: {c['queued']} summaries waiting")
        else:
            print(f"  {c['site']} cut {c['cut_at_s']:g}-{c['restored_at_s']:g} s: {c['queued']} summaries queued, "
                  f"{c['drained']} drained on restore, {c['repairs_while_cut']} repairs while cut")
    ro = s["rollout"]
    if ro:
        print(f"rollout {ro['release']} (canary {ro.get('canary')}, check {ro.get('canary_check')}): {ro['step']}"
              f"{': ' + ro['reason'] if ro.get('reason') else ''}")
        if ro.get("timeline"):
            print(f"  released at {ro['released_at_s']:g} s; {ro['sites_accepted']} sites accepted (last at "
                  f"{ro['last_accepted_s']} s), {ro['sites_switched']} switched (last at {ro['last_switched_s']} s); "
                  f"finished at {ro['finished_at_s']} s")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime import cliargs as ca

    sim = subparsers.add_parser("simulate", help="run a scenario on the discrete-event engine (pure cores)")
    sim.add_argument("scenario", help="a scenario TOML file or a built-in name (site-200, city-10k, hundred-sites)")
    sim.add_argument("--duration", type=ca.float_range(0, 10 * 365 * 86400.0, lo_open=True), default=None,
                     help="override the simulated seconds")
    sim.add_argument("--sites", type=ca.int_range(1, 100_000), default=None,
                     help="override the number of sites of a multi-site scenario ([sites] table)")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=_simulate)
    register_demo(subparsers)


def _demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from runtime.cliargs import checked, writable_dir

    from .demo import DemoConfig, failure_line, run_demo, write_report
    from .report import print_report, write_plots

    out = Path(args.out) if args.out else checked(writable_dir, "--out (default)",
                                                    str(Path("out") / "demo" / time.strftime("%Y%m%d-%H%M%S")))
    cfg = DemoConfig(out=out, agents=args.agents, requests=args.requests, rounds=args.rounds, rule=args.rule)
    result = run_demo(cfg, quiet=args.json)  # a failed step is in the result, not raised: report it too
    try:
        plots = write_plots(result, out)
    except Exception as exc:  # noqa: BLE001 - a plot failure must not hide the report
        plots = []
        print(f"warning: plots not written: {exc}", file=sys.stderr)
    result["plots"] = [str(p) for p in plots]
    report = write_report(out, result)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1, default=str))
    else:
        print_report(result)
        print(f"report: {report}; plots: " + (", ".join(str(p) for p in plots) or "none"))
    failed = failure_line(result)
    if failed is not None:  # the last line: which step, why, where the logs and the partial report are
        print(f"error: {failed}; report (incomplete): {report}", file=sys.stderr)
        return 130 if result.get("interrupted") else 1
    return 0 if result.get("ok") else 1


def _check_rule(name: str) -> None:
    from pathlib import Path

    from cloud_coordinator.aggregation import get_rule

    from .demo import DemoConfig

    # an unknown name raises (a ValueError) naming the choices
    get_rule(name, DemoConfig(out=Path()).byzantine)


def register_demo(sub: argparse._SubParsersAction) -> None:
    from runtime import cliargs as ca

    d = sub.add_parser("demo", help="run the whole system end to end on this machine, with faults, and report")
    d.add_argument("--out", default=None, type=ca.writable_dir,
                   help="output directory (default out/demo/TIMESTAMP)")
    d.add_argument("--agents", type=ca.int_range(11, 200), default=14,
                   help="agents of both sites together (11-200): 8 at the canary store-1, the rest at store-2")
    d.add_argument("--requests", type=ca.int_range(1, 1_000_000), default=200, help="checked requests per site")
    d.add_argument("--rounds", type=ca.int_range(2, 1000), default=5,
                   help="federated rounds (at least 2: the coordinator is killed after one and resumes)")
    d.add_argument("--rule", default="centered_clipping", type=ca.known_name(_check_rule, "aggregation rule"),
                   help="aggregation rule for the federated rounds (e.g. trimmed_mean, nnm+centered_clipping)")
    d.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    d.set_defaults(func=_demo)

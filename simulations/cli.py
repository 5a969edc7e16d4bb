"""``fogline simulate`` (discrete-event fleets) and ``fogline demo`` (real processes)."""
from __future__ import annotations

import argparse
import json
import sys


def _simulate(args: argparse.Namespace) -> int:
    import time

    from .des import run_scenario
    from .scenario import load_scenario

    scenario = load_scenario(args.scenario)
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


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("simulate", help="run a scenario on the discrete-event engine (pure cores)")
    sim.add_argument("scenario", help="a scenario TOML file or a built-in name (site-200, city-10k)")
    sim.add_argument("--duration", type=float, default=None, help="override the simulated seconds")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=_simulate)
    register_demo(subparsers)


def _demo(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from .demo import DemoConfig, run_demo
    from .report import print_report, write_plots

    out = Path(args.out) if args.out else Path("out") / "demo" / time.strftime("%Y%m%d-%H%M%S")
    cfg = DemoConfig(out=out, agents=args.agents, requests=args.requests, rounds=args.rounds, rule=args.rule)
    result = run_demo(cfg, quiet=args.json)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    try:
        plots = write_plots(result, out)
    except Exception as exc:  # noqa: BLE001 - a plot failure must not hide the report
        plots = []
        print(f"warning: plots not written: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1, default=str))
    else:
        print_report(result)
        print(f"report: {out / 'report.json'}; plots: " + ", ".join(str(p) for p in plots))
    return 0 if result.get("ok") else 1


def register_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="run the whole system end to end on this machine, with faults, and report")
    d.add_argument("--out", default=None, help="output directory (default out/demo/TIMESTAMP)")
    d.add_argument("--agents", type=int, default=12)
    d.add_argument("--requests", type=int, default=200)
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--rule", default="centered_clipping", help="aggregation rule for the federated rounds")
    d.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    d.set_defaults(func=_demo)

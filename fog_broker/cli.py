"""``fogline`` subcommands of the fog broker. Each command: an ``_add_*`` and a ``_cmd_*``.

Heavy imports (numpy, onnx, the scheduler) happen inside handlers so that
``fogline --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the fog broker's commands to the ``fogline`` parser."""
    _add_place(subparsers)
    __import__("fog_broker.service_cli", fromlist=["register_service"]).register_service(subparsers)


# --- place ----------------------------------------------------------------------------------


def _add_place(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "place", help="solve a placement offline (no broker) and print the plan",
        description="Place workloads on a fleet under the reference cost model (COST_MODEL.md).")
    p.add_argument("--fleet", required=True, metavar="FLEET.json", help="fleet file")
    p.add_argument("--workloads", required=True, metavar="WORKLOADS.json", help="workloads file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_place)


def _read_json(path: str, what: str) -> Any:
    from runtime.errors import RemoteViolation

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise RemoteViolation(f"cannot read {what} file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise RemoteViolation(f"{what} file {path} is not JSON: {exc}") from exc


def _resolve_models(workloads: Any, base: Path) -> Any:
    """Turn ``model`` (an ONNX path relative to the workloads file) into a chain profile."""
    from dataclasses import replace

    from fog_broker.placement import ChainProfile, SpecError

    out = []
    for w in workloads:
        if w.profile is None and w.model is not None:
            try:
                import onnx

                from .artifacts import model_profile
            except ImportError:
                out.append(w)  # stays pending with a "model" reason
                continue
            path = (base / w.model)
            try:
                prof = ChainProfile.coerce(model_profile(onnx.load(str(path))))
            except (OSError, ValueError) as exc:
                raise SpecError(f"workload {w.name}: cannot profile model {path}: {exc}") from exc
            w = replace(w, profile=prof)
        out.append(w)
    return tuple(out)


def _cmd_place(args: argparse.Namespace) -> int:
    import time

    from fog_broker.placement import Fleet, parse_workloads, schedule
    from runtime.errors import FoglineError

    try:
        fleet = Fleet.from_dict(_read_json(args.fleet, "fleet"))
        workloads, quotas = parse_workloads(_read_json(args.workloads, "workloads"))
        workloads = _resolve_models(workloads, Path(args.workloads).resolve().parent)
        t0 = time.perf_counter()
        plan = schedule(fleet, workloads, quotas=quotas)
        plan = plan.with_solve_s(time.perf_counter() - t0)
    except FoglineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def format_plan(plan: Any) -> str:
    """A kubectl-like table, then one line per pending reason, then the site metrics."""
    rows = [("NAME", "STATUS", "REPLICA", "PARTITIONS", "LATENCY", "ENERGY")]
    for r in plan.workloads:
        if r.placed:
            for k, rep in enumerate(r.replicas):
                parts = " ".join(f"{p.first}-{p.last}@{p.device}" for p in rep.partitions)
                rows.append((r.name if k == 0 else "", "placed" if k == 0 else "", str(k),
                             parts, f"{rep.latency_s * 1e3:.2f}ms", f"{rep.energy_j:.3g}J"))
        else:
            rows.append((r.name, "pending", "-", "-", "-", "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]
    pend = [r for r in plan.workloads if not r.placed]
    if pend:
        lines.append("")
        for r in pend:
            for gate, why in r.reasons:
                lines.append(f"{r.name}: {gate}: {why}")
    if plan.evicted:
        lines.append("")
        lines.append("evicted: " + ", ".join(plan.evicted))
    m = plan.metrics
    lines.append("")
    lines.append(f"utilization {m.utilization:.1%}  fragmentation {m.fragmentation:.1%}  "
                 f"solve {m.solve_s * 1e3:.1f}ms")
    return "\n".join(lines)

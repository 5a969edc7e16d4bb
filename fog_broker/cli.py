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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the fog broker's commands to the ``fogline`` parser."""
    _add_place(subparsers)
    __import__("fog_broker.service_cli", fromlist=["register_service"]).register_service(subparsers)


# --- place ----------------------------------------------------------------------------------


def _add_place(subparsers: argparse._SubParsersAction) -> None:
    from runtime import cliargs as ca

    p = subparsers.add_parser(
        "place", help="solve a placement offline (no broker) and print the plan",
        description="Place workloads on a fleet under the reference cost model (docs/formats.md: the fleet, "
                    "workload and plan JSON; examples in examples/fleets/ and examples/workloads/).")
    p.add_argument("--fleet", required=True, metavar="FLEET.json", type=ca.json_file, help="fleet file")
    p.add_argument("--workloads", required=True, metavar="WORKLOADS.json", type=ca.json_file,
                   help="workloads file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                   help="input shape for every 'model' workload with an input NAME and no "
                        "'input_shapes' of its own (repeatable)")
    p.add_argument("--measure", action="store_true",
                   help="run each placed 'model' workload's partition chain here in "
                        "onnxruntime and report predicted vs measured compute latency")
    p.add_argument("--repeats", type=ca.int_range(1, 100_000), default=20, metavar="N",
                   help="timed runs per chain with --measure (default 20)")
    p.set_defaults(func=_cmd_place)


def _resolve_models(workloads: Any, base: Path, cli_shapes: dict[str, list[int]] | None = None,
                    analyses: dict[str, Any] | None = None) -> Any:
    """Turn ``model`` (``zoo:NAME`` or an ONNX path relative to the workloads file) into a chain profile.

    Input shapes: the workload's ``input_shapes``, else ``--input-shape`` for the inputs
    the model has; named dims still open are pinned at 1, as the fog broker serves.
    ``analyses`` (when given) receives ``name -> (GraphAnalysis, models ChainProfile)``.
    """
    from fog_broker.placement import ChainProfile, SpecError

    todo = [w for w in workloads if w.profile is None and w.model is not None]
    try:
        from models.cuts import DEFAULT_SEGMENTS, chain_profile
        from models.errors import ModelError
        from models.graph import serving_dims
        from models.graph_files import load_model
        from models.probe import analyze
    except ImportError:
        return tuple(workloads)  # model workloads stay pending with a "model" reason
    loaded: dict[str, Any] = {}
    sources: dict[str, Any] = {}
    for w in todo:
        try:
            sources[w.name] = _model_source(w.name, w.model, base)
            loaded[w.name] = load_model(sources[w.name])
        except ModelError as exc:
            raise SpecError(f"workload {w.name}: {exc}") from None
    shaped: dict[str, dict[str, list[int]]] = {}
    for w in todo:
        names = {vi.name for vi in loaded[w.name].graph.input}
        own = {k: list(v) for k, v in w.input_shapes}
        shaped[w.name] = own or {k: v for k, v in (cli_shapes or {}).items() if k in names}
    unused = sorted(set(cli_shapes or ()) - {k for v in shaped.values() for k in v})
    if unused:
        raise SpecError(f"--input-shape {unused[0]}: no 'model' workload without its own "
                        f"input_shapes has an input '{unused[0]}'")
    out = []
    for w in workloads:
        if w.name in loaded:
            model, shapes = loaded[w.name], shaped[w.name]
            try:
                ga = analyze(sources[w.name], dims=serving_dims(model, shapes),
                             input_shapes=shapes)
                mcp = chain_profile(ga, DEFAULT_SEGMENTS, strategy="balanced")
            except ModelError as exc:
                raise SpecError(f"workload {w.name}: {exc}") from None
            if analyses is not None:
                analyses[w.name] = (ga, mcp)
            w = w.with_profile(ChainProfile.coerce(mcp))
        out.append(w)
    return tuple(out)


def _model_source(name: str, model: str, base: Path) -> Any:
    """What ``models.graph`` loads for a workload's ``model``: a zoo model (built here) or a file."""
    from fog_broker.placement import SpecError

    if model.startswith("zoo:"):
        from models import zoo

        return zoo.build(model[4:])  # an unknown name raises ModelError naming the choices
    if model.startswith(("release:", "file:")):
        raise SpecError(f"workload {name}: {model.partition(':')[0]}: models live on a fog broker; "
                        "fogline place takes zoo:NAME, an ONNX path or an inline 'profile'")
    return base / model


def _measure(plan: Any, workloads: Any, analyses: dict[str, Any], fleet: Any,
             repeats: int) -> dict[str, Any]:
    """Predicted (the plan's cost model) vs measured (this machine) compute of each chain."""
    import statistics

    from models.timing import time_segments

    rows: dict[str, Any] = {}
    by_name = {w.name: w for w in workloads}
    for r in plan.workloads:
        if not r.placed or r.name not in analyses:
            continue
        ga, mcp = analyses[r.name]
        prof = by_name[r.name].profile
        rep = r.replicas[0]
        cuts = [mcp.segments[p.first].start for p in rep.partitions[1:]]
        timed = time_segments(ga, cuts, repeats=repeats)
        predicted = [prof.compute_s(p.first, p.last, fleet.get(p.device))
                     for p in rep.partitions]
        total = sum(predicted)
        rows[r.name] = {
            "predicted_latency_s": rep.latency_s,
            "predicted_compute_s": total,
            "measured_compute_s": timed.chain_s,
            "error": (total - timed.chain_s) / timed.chain_s if timed.chain_s > 0 else 0.0,
            "partitions": [{"segments": [p.first, p.last], "device": p.device,
                            "predicted_s": t, "measured_s": m}
                           for p, t, m in zip(rep.partitions, predicted, timed.seconds)],
            "measured_with": "this machine, onnxruntime " + ",".join(timed.providers)
                             + f", {timed.threads} thread(s), median of {timed.repeats}",
        }
    errs = [abs(v["error"]) for v in rows.values()]
    return {"workloads": rows,
            "median_abs_error": statistics.median(errs) if errs else None}


def _cmd_place(args: argparse.Namespace) -> int:
    import time

    from fog_broker.placement import Fleet, parse_workloads, schedule
    from runtime.errors import FoglineError

    try:
        from models.cli import parse_input_shapes

        fleet = _parsed(args.fleet, Fleet.from_dict)
        workloads, quotas = _parsed(args.workloads, parse_workloads)
        analyses: dict[str, Any] = {}
        workloads = _resolve_models(workloads, args.workloads.path.resolve().parent,
                                    parse_input_shapes(args.input_shape), analyses)
        t0 = time.perf_counter()
        plan = schedule(fleet, workloads, quotas=quotas)
        plan = plan.with_solve_s(time.perf_counter() - t0)
        check = _measure(plan, workloads, analyses, fleet, args.repeats) if args.measure \
            else None
    except FoglineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.to_dict()
        if check is not None:
            out["latency_check"] = check
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan))
        if check is not None:
            print(format_check(check))
    return 0


def _parsed(src: Any, parse: Any) -> Any:
    """``parse(src.doc)`` with the file named in its error."""
    from fog_broker.placement import SpecError

    try:
        return parse(src.doc)
    except SpecError as exc:
        raise SpecError(f"{src.path}: {exc}") from None


def format_check(check: dict[str, Any]) -> str:
    """Predicted vs measured compute latency, one line per workload."""
    lines = ["", "predicted vs measured compute (this machine):"]
    for name, row in check["workloads"].items():
        lines.append(f"  {name}: predicted {row['predicted_compute_s'] * 1e3:.2f}ms  measured "
                     f"{row['measured_compute_s'] * 1e3:.2f}ms  error {row['error']:+.1%}")
    if check["median_abs_error"] is not None:
        lines.append(f"  median |error| {check['median_abs_error']:.1%}")
    else:
        lines.append("  no placed workload names an ONNX model")
    return "\n".join(lines)


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

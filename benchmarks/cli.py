"""``fogline bench``: the benchmarks register their own command (entry point ``fogline.commands``),
so ``runtime.cli`` never names the benchmarks package."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent
    names = sorted(p.stem[:-6] for p in root.glob("*_bench.py"))
    if args.name == "list":
        print("benchmarks: " + ", ".join(names))
        return 0
    if args.name.replace("-", "_") in names:  # serving-overhead: the module is serving_overhead_bench
        args.name = args.name.replace("-", "_")
    if args.name not in names + ["all"]:
        print(f"error: unknown benchmark {args.name!r}; choose from all, list, {', '.join(names)}",
              file=sys.stderr)
        return 2
    if str(root.parent) not in sys.path:
        sys.path.insert(0, str(root.parent))
    # a failing benchmark is one error line and a record (out/bench/run.json), not a traceback
    runner = importlib.import_module("benchmarks._runner")
    return int(runner.run_benchmarks(names if args.name == "all" else [args.name], list(args.rest)))


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark (JSON out): fogline bench list")
    bench.add_argument("name", help="benchmark name, 'all' or 'list'")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=_bench)

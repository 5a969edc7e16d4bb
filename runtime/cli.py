"""The ``fogline`` command: one entry point, subcommands contributed by each package.

Each package that has commands exposes ``register(subparsers)`` in its
``cli`` module; handlers return an exit code (2 for bad input). Heavy
imports happen inside handlers so ``fogline --help`` and the agent start fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import runpy
import sys
from pathlib import Path
from typing import Sequence

from .errors import FoglineError

__all__ = ["main", "build_parser"]

_COMMAND_MODULES = (
    "edge_agent.cli",
    "fog_broker.cli",
    "cloud_coordinator.cli",
    "models.cli",
    "simulations.cli",
)


def _bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    if not root.is_dir():
        print("error: benchmarks/ not found; run from a source checkout", file=sys.stderr)
        return 2
    names = sorted(p.stem[:-6] for p in root.glob("*_bench.py"))
    if args.name == "list" or args.name not in names + ["all"]:
        print("benchmarks: " + ", ".join(names))
        return 0 if args.name == "list" else 2
    sys.path.insert(0, str(root.parent))
    code = 0
    for name in names if args.name == "all" else [args.name]:
        mod = importlib.import_module(f"benchmarks.{name}_bench")
        rc = mod.main(list(args.rest))
        code = code or (rc or 0)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fogline",
        description="Fogline: place ONNX model partitions on edge fleets and train them with Flower.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="run a benchmark (JSON out): fogline bench list")
    bench.add_argument("name", help="benchmark name, 'all' or 'list'")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=_bench)
    for modname in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:
                continue  # package has no commands (yet)
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FoglineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # a peer that did not answer: one line, not a traceback
        print(f"error: {exc or 'timed out'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

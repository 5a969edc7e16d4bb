"""The ``fogline`` command: one entry point, subcommands contributed by each package.

Each package that has commands exposes ``register(subparsers)`` (in its ``cli`` module) and
names it under the ``fogline.commands`` entry points in pyproject.toml; this module imports
nothing above ``runtime``. Handlers return an exit code (2 for bad input). Heavy imports happen
inside handlers so ``fogline --help`` and the agent start fast.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import FoglineError

__all__ = ["main", "build_parser"]

#: Packages contribute subcommands by entry point: ``name = "pkg.cli:register"`` under this group
#: in pyproject.toml, ``register(subparsers)`` adding the parsers; runtime names none of them.
COMMANDS_GROUP = "fogline.commands"
_CHECKOUT = Path(__file__).resolve().parents[1]


def _command_entry_points() -> list[tuple[str, str]]:
    """(name, "module:function") of every registered subcommand, in the metadata's order.

    From the installed metadata; from a source checkout's pyproject.toml when the project is not
    installed (``python -m runtime.cli`` in a fresh clone).
    """
    eps = [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)]
    if eps:
        return eps
    pyproject = _CHECKOUT / "pyproject.toml"
    if not pyproject.is_file():
        return []
    try:
        import tomllib  # novermin - 3.11+; the agent runs on 3.10 (JetPack 6) from an install
    except ImportError:
        return []
    with pyproject.open("rb") as f:
        table = tomllib.load(f).get("project", {}).get("entry-points", {}).get(COMMANDS_GROUP, {})
    return [(str(k), str(v)) for k, v in table.items()]


def _load(value: str) -> Callable[[Any], None] | None:
    """The ``register`` function an entry point names; None when its package is not present (a
    checkout-only package such as the benchmarks, run from an install without them)."""
    modname, _, attr = value.partition(":")
    for attempt in range(2):
        try:
            mod = importlib.import_module(modname)
            break
        except ModuleNotFoundError as exc:
            if exc.name is None or not (modname == exc.name or modname.startswith(exc.name + ".")):
                raise  # the package is there but one of its imports is not: a real failure
            if attempt or not (_CHECKOUT / "pyproject.toml").is_file():
                return None
            sys.path.append(str(_CHECKOUT))  # checkout-only packages live next to runtime/
    fn: Callable[[Any], None] = getattr(mod, attr or "register")
    return fn


class _Parser(argparse.ArgumentParser):
    """Every ``fogline`` parser (subparsers inherit the class): a bad argument is one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fogline",
        description="Fogline: place ONNX model partitions on edge fleets and train them with Flower.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, value in _command_entry_points():
        register = _load(value)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # every argument type checks its value (runtime.cliargs)
    except SystemExit as exc:  # --help (0), or one "error: argument ..." line (2): a code, for callers
        return exc.code if isinstance(exc.code, int) else 2
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
    except OSError as exc:  # a path the user gave that we cannot read or write: one line
        flag = _argument_of(parser, args, exc)
        if flag is None:
            raise  # not about the user's input: a real failure keeps its traceback
        print(f"error: {flag} {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``dest -> --long-flag`` (or the positional's name) over the whole parser tree."""
    out: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for dest, flag in _flags(sub).items():
                    out.setdefault(dest, flag)
        elif action.option_strings:
            out.setdefault(action.dest, max(action.option_strings, key=len))
        else:
            meta = action.metavar if isinstance(action.metavar, str) else None
            out.setdefault(action.dest, meta or action.dest.upper())
    return out


def _argument_of(parser: argparse.ArgumentParser, args: argparse.Namespace, exc: OSError) -> str | None:
    """The argument whose path ``exc`` is about (the path itself or inside it), or None."""
    names = [n for n in (exc.filename, exc.filename2) if isinstance(n, (str, bytes, Path))]
    if not names:
        return None
    failed = [Path(os.fsdecode(n)).absolute() for n in names]
    flags = _flags(parser)
    for dest, value in vars(args).items():
        value = getattr(value, "path", value)  # a cliargs.JsonFile
        if dest in ("func", "command") or not isinstance(value, (str, Path)) or not str(value):
            continue
        given = Path(value).expanduser().absolute()
        if any(f == given or given in f.parents for f in failed):
            return flags.get(dest, "--" + dest.replace("_", "-"))
    return None


if __name__ == "__main__":
    sys.exit(main())

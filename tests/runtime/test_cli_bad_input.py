"""Every ``fogline`` subcommand refuses bad arguments with one ``error:`` line and exit code 2.

The commands and their options come from the argparse parser itself (``runtime.cli.build_parser``),
not from a list kept here: a new subcommand or option is covered the day it is added. Each option
gets a family of bad values picked by what the parser says it takes (its ``type`` from
``runtime.cliargs``, a builtin ``int``/``float``, ``choices``, a ``Path``), one at a time, on top
of the minimal valid arguments the command needs. Each case runs in-process (``main(argv)``)
under a timer, in a temporary cwd, and must: exit 2, print no traceback, print exactly one line
with ``error:``, and leave nothing new behind (no half-created output directory).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import cliargs
from runtime.cli import build_parser, main

CASE_TIMEOUT_S = 10.0
# The fixtures every case finds in its cwd (made before the snapshot; never counted as leftovers).
FILE, DIR, TEXT, JSON_STR, JSON_LIST, JSON_BAD = ("a-file.json", "a-dir", "a-text.txt", "a-string.json",
                                                  "a-list.json", "bad-types.json")
VALID_JSON = "valid.json"
ONNX = "model.onnx"
UNCREATABLE = "/proc/fogline-no-such-dir/sub"  # /proc takes no new directories, not even from root


class _CaseTimeout(BaseException):
    """Raised in the main thread by SIGALRM: a case that started work it should have refused."""


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _leaves(child, path + (name,))


def _kind(action: argparse.Action) -> str:
    t = action.type
    if hasattr(t, "kind"):
        return str(t.kind)  # type: ignore[union-attr]
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "choices"
    if t is int:
        return "builtin_int"
    if t is float:
        return "builtin_float"
    if t is Path:
        return "path"
    return "text"


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and action.nargs != argparse.REMAINDER and not isinstance(
        action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))


def _bad_values(action: argparse.Action) -> list[str]:
    """Values this option must refuse, from what the parser says it takes."""
    kind = _kind(action)
    t: Any = action.type
    if kind == "hostport":
        return ["h:notaport", "h:99999", ":1883", "h:-1", "h:1883:9"]
    if kind == "int":
        out = ["abc", "1.5"]
        if t.lo is not None:
            out += [str(t.lo - 1), str(t.lo - 10**6)]
        if t.hi is not None:
            out += [str(t.hi + 1), str(10**30)]
        return out
    if kind == "float":
        out = ["abc", "nan", "inf", "-inf"]
        if t.lo is not None:
            out += [str(t.lo - 1)] + ([str(t.lo)] if t.lo_open else [])
        if t.hi is not None:
            out += [str(t.hi * 10 + 1), "1e308"]
        return out
    if kind == "builtin_int":
        return ["abc", "1.5"]
    if kind == "builtin_float":
        return ["abc"]
    if kind == "writable_dir":
        return [f"{FILE}/sub", FILE, UNCREATABLE]
    if kind == "writable_file":
        return [DIR, f"{FILE}/out.npz", UNCREATABLE + "/out.npz"]
    if kind == "existing_file":
        return ["missing.json", DIR, f"{FILE}/sub"]
    if kind == "existing_dir":
        return ["missing-dir", FILE]
    if kind == "json_file":
        return ["missing.json", DIR, TEXT, JSON_STR, JSON_LIST, JSON_BAD]
    if kind in ("name", "choices"):
        return ["nosuch-name"]
    if kind == "path":
        return [f"{FILE}/sub"]  # neither readable nor creatable, whatever the command does with it
    return []  # free text: no value is wrong by its form alone


def _valid_value(action: argparse.Action) -> str:
    """A value that passes the option's own check (the command may still refuse it later)."""
    kind = _kind(action)
    t: Any = action.type
    if kind == "hostport":
        return "127.0.0.1:9"
    if kind == "int":
        return str(t.lo if t.lo is not None else 1)
    if kind == "float":
        return str((t.lo or 0) + 1)
    if kind in ("builtin_int", "builtin_float"):
        return "1"
    if kind == "writable_dir":
        return f"fresh-{action.dest}"  # does not exist: a refused command must not create it
    if kind == "writable_file":
        return f"fresh-{action.dest}.out"
    if kind == "existing_file":
        return ONNX
    if kind in ("existing_dir", "path"):
        return DIR
    if kind == "json_file":
        return VALID_JSON
    if kind == "choices":
        return str(next(iter(action.choices)))  # type: ignore[arg-type]
    if kind == "name" and isinstance(action.default, str):
        return action.default
    return "1"


def _argv_with(path: tuple[str, ...], parser: argparse.ArgumentParser,
               target: argparse.Action, bad: str) -> list[str]:
    """``path`` + the minimal valid arguments + ``target`` set to ``bad``."""
    argv = list(path)
    groups = [g for g in parser._mutually_exclusive_groups if g.required]
    need = [a for a in parser._actions if a.required and _takes_value(a) and a is not target]
    for g in groups:
        if target not in g._group_actions:
            need.append(next(a for a in g._group_actions if _takes_value(a)))
    for a in need:
        if a.option_strings:
            argv += [a.option_strings[-1], _valid_value(a)]
    pos_before = []
    for a in parser._actions:  # positionals in order; the target's bad value in its place
        if a.option_strings or not _takes_value(a):
            continue
        if a is target:
            pos_before.append(bad)
        elif a.required or a.nargs in (None, 1):
            pos_before.append(_valid_value(a))
    if target.option_strings:
        argv += [target.option_strings[-1], bad]
    return argv + pos_before


PARSER = build_parser()
LEAVES = dict(_leaves(PARSER))


def _cases() -> list[tuple[tuple[str, ...], str]]:
    out = []
    for path, parser in LEAVES.items():
        for a in parser._actions:
            if _takes_value(a) and _bad_values(a):
                out.append((path, a.dest))
    return out


CASES = _cases()


def _fixtures(cwd: Path) -> None:
    (cwd / FILE).write_text("{}")
    (cwd / DIR).mkdir()
    (cwd / TEXT).write_text("this is not JSON\n")
    (cwd / JSON_STR).write_text('"a workload"')
    (cwd / JSON_LIST).write_text('[{"name": "w"}]')
    (cwd / JSON_BAD).write_text(json.dumps({"workloads": [{"name": 5, "replicas": "two"}], "devices": 7}))
    dev = {"id": "d", "flops": 1e9, "memory_bytes": 1e9, "uplink_bps": 1e8, "downlink_bps": 1e8}
    (cwd / VALID_JSON).write_text(json.dumps({"devices": [dev], "workloads": [
        {"name": "w", "source": "d", "sink": "d", "model": "zoo:mlp"}]}))
    (cwd / ONNX).write_bytes(b"not an onnx model")


def _snapshot(cwd: Path) -> set[str]:
    return {str(p.relative_to(cwd)) for p in cwd.rglob("*")}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | None, str]:
    def alarm(signum: int, frame: Any) -> None:
        raise _CaseTimeout

    logging.root.handlers.clear()  # main() logs to this case's captured stderr
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    code: int | None
    try:
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except _CaseTimeout:
            code = None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize("path,dest", CASES, ids=[f"{' '.join(p)}:{d}" for p, d in CASES])
def test_bad_values_are_refused(path: tuple[str, ...], dest: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    parser = LEAVES[path]
    action = next(a for a in parser._actions if a.dest == dest and _takes_value(a))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FOGLINE_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / DIR))  # ~/.fogline/... defaults: an empty directory
    _fixtures(tmp_path)
    before = _snapshot(tmp_path)
    failures = []
    for bad in _bad_values(action):
        argv = _argv_with(path, parser, action, bad)
        code, err = _run(argv, capsys)
        errors = [ln for ln in err.splitlines() if "error:" in ln]
        left = sorted(_snapshot(tmp_path) - before)
        why = []
        if code is None:
            why.append(f"still running after {CASE_TIMEOUT_S:g} s")
        elif code != 2:
            why.append(f"exit {code}")
        if "Traceback" in err:
            why.append("a traceback")
        if len(errors) != 1:
            why.append(f"{len(errors)} error lines")
        if left:
            why.append(f"left {left}")
        if why:
            failures.append(f"fogline {' '.join(argv)}: {', '.join(why)}\n    {err.strip()[-400:]}")
    assert not failures, "\n".join(failures)


def test_every_command_is_walked() -> None:
    """The walk reaches the commands a newcomer meets first (a guard against an empty parametrize)."""
    walked = {" ".join(p) for p, _ in CASES}
    for cmd in ("broker", "deploy", "status", "place", "demo", "simulate", "agent", "coordinator",
                "models zoo", "sites release", "supernodes keygen", "site-aggregator"):
        assert cmd in walked, cmd


def test_paths_and_addresses_have_checking_types() -> None:
    """An option whose name says directory, file or address is checked by its type (runtime.cliargs),
    so the walk above feeds it bad values: a new ``--out`` without one fails here."""
    unchecked = []
    for path, parser in LEAVES.items():
        for a in parser._actions:
            meta = a.metavar if isinstance(a.metavar, str) else ""
            says = a.dest.endswith(("_dir", "_file", "out")) or bool(
                re.search(r"(^|[^A-Z])(DIR|FILE)$|\.(json|npz|toml|onnx)$|HOST:PORT$", meta))
            if _takes_value(a) and says and _kind(a) == "text":
                unchecked.append(f"fogline {' '.join(path)} {a.option_strings or a.dest}")
    assert not unchecked, unchecked


@pytest.mark.parametrize("text,want", [
    ("127.0.0.1:1884", ("127.0.0.1", 1884)), ("broker", ("broker", None)), ("[::1]:8883", ("::1", 8883)),
    ("::1", ("::1", None)), ("[fe80::1]", ("fe80::1", None)), (" h:1 ", ("h", 1)),
])
def test_split_hostport(text: str, want: tuple[str, int | None]) -> None:
    from runtime.net import split_hostport

    assert split_hostport(text) == want


@pytest.mark.parametrize("text", ["h:notaport", "h:99999", ":1883", "h:-1", "[::1", "[::1]x", "a b:1", ""])
def test_split_hostport_refuses(text: str) -> None:
    from runtime.net import split_hostport

    with pytest.raises(ValueError, match="HOST:PORT"):
        split_hostport(text)


def test_broker_without_port_is_8883_with_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--broker HOST`` dials MQTT over TLS on 8883; 1883 only with --insecure."""
    import fog_broker.client as client
    from fog_broker import service_cli

    seen = []

    class Fake:
        def __init__(self, host: str, port: int, **kw: Any) -> None:
            seen.append((host, port))

    monkeypatch.setattr(client, "FogClient", Fake)
    for insecure, port in ((False, 8883), (True, 1883)):
        service_cli._client(argparse.Namespace(broker="127.0.0.1", credentials=None, insecure=insecure))
        assert seen[-1] == ("127.0.0.1", port)


def test_bench_unknown_name_says_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown benchmark 'nosuch'") and "Traceback" not in err


def test_unreadable_output_path_of_a_handler_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError about a path the user gave, raised deep in a handler, names the argument (exit 2);
    one about any other path keeps its traceback (a real failure is not hidden)."""
    from runtime import cli

    def handler(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", str(args.out / "x" / "y"))

    parser = argparse.ArgumentParser(prog="t")
    parser.add_argument("--out", type=cliargs.writable_dir)
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, handler))
    assert main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--out" in err and "Permission denied" in err

    def other(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", "/somewhere/else")

    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, other))
    with pytest.raises(PermissionError):
        main(["--out", str(tmp_path)])


def _with_func(parser: argparse.ArgumentParser, fn: Any) -> argparse.ArgumentParser:
    parser.set_defaults(func=fn, verbose=0)
    return parser


def test_probe_leaves_nothing(tmp_path: Path) -> None:
    assert cliargs.writable_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []
    assert os.access(tmp_path, os.W_OK)

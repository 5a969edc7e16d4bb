"""Argument types for every ``fogline`` command: bad input is refused by argparse, before any work.

Each type is a callable for argparse's ``type=``: it returns the value (a string, a number, a
``Path``) or raises ``argparse.ArgumentTypeError`` with a short reason, which argparse prints as
one ``error: argument --flag: reason`` line with exit code 2. Nothing here creates a file or a
directory: a command that fails its arguments leaves nothing behind. Each type carries ``kind``
(and numeric ones their bounds) so a test can walk the parser and feed every option bad values.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FoglineError
from .net import split_hostport

__all__ = [
    "hostport", "host_or_hostport", "hostport_or_empty", "port", "port_or_zero", "int_range", "float_range",
    "positive_int", "nonneg_int", "positive_float", "nonneg_float", "writable_dir", "writable_file",
    "existing_file", "existing_dir", "json_file", "JsonFile", "ArgError", "known_name",
    "UsageError", "checked",
]

ArgError = argparse.ArgumentTypeError


class UsageError(FoglineError, ValueError):
    """Bad input found by a handler (not by argparse): ``fogline`` prints one ``error:`` line, exit 2."""


def _kind(kind: str, **attrs: Any) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    def mark(fn: Callable[[str], Any]) -> Callable[[str], Any]:
        fn.kind = kind  # type: ignore[attr-defined]
        for k, v in attrs.items():
            setattr(fn, k, v)
        return fn
    return mark


# --- addresses ------------------------------------------------------------------------------


def _address(text: str, need_port: bool) -> str:
    try:
        _, p = split_hostport(text)
    except ValueError as exc:
        raise ArgError(str(exc)) from None
    if need_port and p is None:
        raise ArgError(f"expected HOST:PORT, got {text!r} (no port)")
    if p is not None and not 1 <= p <= 65535:
        raise ArgError(f"port {p} of {text!r} is not a TCP port (1-65535)")
    return text.strip()


@_kind("hostport")
def hostport(text: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too), port 1-65535; returns the text for ``parse_hostport``."""
    return _address(text, True)


@_kind("hostport")
def host_or_hostport(text: str) -> str:
    """``HOST`` or ``HOST:PORT``: the command picks the default port (TLS or not)."""
    return _address(text, False)


@_kind("hostport")
def hostport_or_empty(text: str) -> str:
    """``HOST:PORT``, or ``""`` for an option whose empty default means "none"."""
    return "" if text == "" else _address(text, True)


# --- numbers --------------------------------------------------------------------------------


def int_range(lo: int | None = None, hi: int | None = None, what: str = "in range") -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (either bound may be open)."""

    @_kind("int", lo=lo, hi=hi)
    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise ArgError(f"expected an integer, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ArgError(_out_of_range(f"{v}", what, _bounds(lo, hi)))
        return v

    parse.__name__ = what.replace(" ", "_")
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                what: str = "in range") -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    @_kind("float", lo=lo, hi=hi, lo_open=lo_open)
    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise ArgError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise ArgError(f"expected a finite number, got {text!r}")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise ArgError(_out_of_range(f"{v:g}", what, _bounds(lo, hi, lo_open)))
        return v

    parse.__name__ = what.replace(" ", "_")
    return parse


def _out_of_range(value: str, what: str, bounds: str) -> str:
    return f"{value} is out of range: {bounds}" if what == "in range" else f"{value} is not {what}"


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if hi is None:
        return f"must be {'>' if lo_open else '>='} {lo:g}"
    if lo is None:
        return f"must be <= {hi:g}"
    return f"must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"


port = int_range(1, 65535, "a TCP port (1-65535)")
port_or_zero = int_range(0, 65535, "a TCP port (0-65535; 0: any free one)")
positive_int = int_range(1, None, "a positive integer")
nonneg_int = int_range(0, None, "an integer >= 0")
positive_float = float_range(0.0, None, lo_open=True, what="a positive number")
nonneg_float = float_range(0.0, None, what="a number >= 0")


# --- paths ----------------------------------------------------------------------------------


def _why(path: Path) -> str | None:
    """Why ``path`` cannot be made a directory we write in, or None when it can (nothing is created)."""
    p = path
    while True:
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                return f"{p} is not a directory" if p == path else f"{p} is a file, not a directory"
            why = _probe(p)
            if why is not None:
                return f"{p} is not writable ({why})" if p == path else f"cannot create it in {p}: {why}"
            return None
        if p.parent == p:
            return f"no existing directory above {path}"
        p = p.parent


def _probe(directory: Path) -> str | None:
    """Make and remove an empty directory in ``directory``: the one test that root, read-only
    file systems, ACLs and /proc all answer truthfully. Returns why it failed, or None."""
    import tempfile  # only when a path is checked: ``fogline --help`` stays fast

    if not os.access(directory, os.W_OK | os.X_OK):
        return "permission denied"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fogline-probe-", dir=directory))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _path(text: str) -> Path:
    if not text or "\x00" in text:
        raise ArgError(f"not a path: {text!r}")
    return Path(text).expanduser()


@_kind("writable_dir")
def writable_dir(text: str) -> Path:
    """A directory the command may create or write in (it is not created here)."""
    path = _path(text)
    return _writable_in(path, path)


@_kind("writable_file")
def writable_file(text: str) -> Path:
    """A file the command may write (its directory exists or can be made; it is not a directory)."""
    path = _path(text)
    if path.is_dir():
        raise ArgError(f"{path} is a directory, not a file")
    return _writable_in(path, path.parent)


def _writable_in(path: Path, directory: Path) -> Path:
    """``path`` when ``directory`` exists and is writable or can be made, else why not."""
    why = _why(directory)
    if why is not None:
        raise ArgError(why)
    return path


@_kind("existing_file")
def existing_file(text: str) -> Path:
    """A readable regular file."""
    return _readable(_path(text), directory=False)


@_kind("existing_dir")
def existing_dir(text: str) -> Path:
    """A readable directory."""
    return _readable(_path(text), directory=True)


def _readable(path: Path, *, directory: bool) -> Path:
    if not path.exists():
        raise ArgError(f"{path} does not exist: no such {'directory' if directory else 'file'}")
    if path.is_dir() != directory:
        raise ArgError(f"{path} is not a directory" if directory else f"{path} is a directory, not a file")
    if not os.access(path, os.R_OK | os.X_OK if directory else os.R_OK):
        raise ArgError(f"{path} is not readable")
    return path


@dataclass(frozen=True, slots=True)
class JsonFile:
    """A JSON document and the file it came from (relative paths inside resolve against it)."""

    path: Path
    doc: Any

    def __str__(self) -> str:
        return str(self.path)


#: JSON files larger than this are refused before parsing (a workload or fleet is far smaller).
MAX_JSON_BYTES = 64 * 1024 * 1024


@_kind("json_file")
def json_file(text: str) -> JsonFile:
    """A readable file holding one JSON object (a top-level list, string or number is refused)."""
    path = existing_file(text)
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ArgError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB")
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
    except OSError as exc:
        raise ArgError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ArgError(f"{path} is not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise ArgError(f"{path} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ArgError(f"{path} is not JSON this program reads (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ArgError(f"{path} holds a JSON {_json_type(doc)}, expected an object {{...}}")
    return JsonFile(path, doc)


def _json_type(v: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def known_name(check: Callable[[str], Any], what: str = "name") -> Callable[[str], str]:
    """A name that ``check`` accepts (it raises ValueError, with the choices, for an unknown one).

    ``check`` may import lazily: it runs only for the command whose option it types.
    """

    @_kind("name")
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise ArgError(str(exc)) from None
        return text

    parse.__name__ = what.replace(" ", "_")
    return parse


def checked(parse: Callable[[str], Any], flag: str, text: str) -> Any:
    """``parse(text)`` for a value a handler computed (a default path): its error as ``UsageError``."""
    try:
        return parse(text)
    except ArgError as exc:
        raise UsageError(f"{flag}: {exc}") from None

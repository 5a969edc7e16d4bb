"""The one grammar of Fogline identifiers: device ids, identity names, fog ids and site names.

An identifier becomes a certificate CN, an MQTT username and client id, a topic
level, a line of mosquitto's ACL and a directory name, so it must be tame in all
of them at once. The grammar (``ID_GRAMMAR``):

* 1 to 64 characters (``MAX_ID_LEN``) of ``A-Z a-z 0-9 . _ -``;
* the first one a letter or a digit (no ``.``/``-`` lead: no hidden files, no options);
* no ``..`` anywhere (no parent directory).

The whole string must match (``re.fullmatch``): ``re.match(r"^...$")`` lets a
trailing newline through, and an id ``"a\\n"`` once broke the ACL file. Pure: no I/O.
"""
from __future__ import annotations

import re

from .errors import RemoteViolation

__all__ = ["MAX_ID_LEN", "ID_GRAMMAR", "ID_PATTERN", "InvalidId", "is_id", "check_id", "id_problem"]

MAX_ID_LEN = 64
ID_GRAMMAR = "1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'"
# the regex half of the grammar (the other half: no ".."), for matchers built on it (the ACL check)
ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_ID = re.compile(ID_PATTERN)


class InvalidId(RemoteViolation):
    """A string that is not an identifier of ``ID_GRAMMAR``."""


def is_id(value: object) -> bool:
    """True when ``value`` is a str of the identifier grammar (the whole of it)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None and ".." not in value


def id_problem(value: object, what: str = "id") -> str:
    """The one-line reason ``value`` is not an identifier ("" when it is one); the value is shown
    escaped and cut, so a newline or a megabyte in it cannot break a log line."""
    if is_id(value):
        return ""
    shown = repr(value[:40]) if isinstance(value, str) else type(value).__name__
    return f"invalid {what} {shown}: {ID_GRAMMAR}"


def check_id(value: object, what: str = "id") -> str:
    """``value`` when it is an identifier; ``InvalidId`` with a one-line reason otherwise."""
    problem = id_problem(value, what)
    if problem:
        raise InvalidId(problem)
    return value  # type: ignore[return-value]

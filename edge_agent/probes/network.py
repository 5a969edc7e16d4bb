"""Metered links: NetworkManager's ``GENERAL.METERED`` of the default route's interface (pure).

A phone hotspot or an LTE modem is metered: NetworkManager guesses it ("yes (guessed)") or the
owner sets it (``nmcli connection modify ID connection.metered yes``). The fog and the
coordinator keep training and bulk transfers off such links. An operator's ``--metered`` /
``--unmetered`` overrides whatever the probe reads.
"""
from __future__ import annotations

from pathlib import Path

from ._sysfs import read_text

__all__ = ["parse_nmcli_metered", "default_interface", "metered"]


def parse_nmcli_metered(text: str | None) -> bool | None:
    """``nmcli -t -f GENERAL.METERED dev show IFACE`` output: True/False, None when unknown.

    Terse output is ``GENERAL.METERED:yes (guessed)``; plain output pads with spaces.
    NetworkManager says ``unknown`` when it has no idea (then the link counts as unmetered).
    """
    if not text:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep or name.strip() != "GENERAL.METERED":
            continue
        word = value.strip().split(" ", 1)[0].lower() if value.strip() else ""
        if word == "yes":
            return True
        if word == "no":
            return False
        return None
    return None


def default_interface(root: Path | str) -> str | None:
    """The interface of the IPv4 default route with the lowest metric (``/proc/net/route``)."""
    text = read_text(root, "proc/net/route")
    if not text:
        return None
    best: tuple[int, str] | None = None
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8 or cols[1] != "00000000" or cols[7] != "00000000":
            continue  # not a default route (destination and mask 0.0.0.0)
        try:
            flags, metric = int(cols[3], 16), int(cols[6])
        except ValueError:
            continue
        if not flags & 0x1:  # RTF_UP
            continue
        if best is None or metric < best[0]:
            best = (metric, cols[0])
    return best[1] if best else None


def metered(nmcli_output: str | None, override: bool | None = None) -> bool:
    """The operator's override when given, else NetworkManager's answer (unknown: unmetered)."""
    if override is not None:
        return override
    return bool(parse_nmcli_metered(nmcli_output))

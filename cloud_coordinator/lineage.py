"""Checkpoints bound to their experiment: the app and run config a checkpoint lineage was trained with.

A work directory's checkpoints continue one model. Resuming them with another
app (other code, another model) or another run config (learning rate, data
split, rule) would either fail deep inside a ServerApp or, worse, quietly mix
two experiments; starting over silently would discard them. So the
coordinator records the lineage (``lineage.json``: a digest of the app's
files and of its model-relevant run config) and refuses, in one line, to
resume under a different one unless told ``--new-lineage``. A new lineage
gets a new id, which is part of the strategy's config hash: the old
checkpoints stay on disk but are never resumed into the new model.

Operational knobs (how many rounds, timeouts) are not part of the lineage:
extending a run with ``--rounds`` is a resume.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import LocalViolation
from runtime.files import atomic_write

__all__ = ["LINEAGE_FILE", "OPERATIONAL_KEYS", "Lineage", "LineageMismatch", "app_digest", "config_digest",
           "decide", "bind"]

LINEAGE_FILE = "lineage.json"
SOURCE_SUFFIXES = frozenset({".py", ".toml", ".cfg", ".ini"})
OPERATIONAL_KEYS = frozenset({"num-server-rounds", "round-timeout", "grace", "min-train-nodes", "fogline-settings",
                              "fraction-evaluate"})


class LineageMismatch(LocalViolation):
    """The checkpoints here belong to another app or run config."""


@dataclass(frozen=True, slots=True)
class Lineage:
    id: str        # "" for the first lineage of a work directory (config hashes as before)
    app: str       # digest of the app's files
    config: str    # digest of its model-relevant run config

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "app": self.app, "config": self.config}, indent=1)


def app_digest(app_dir: Path) -> str:
    """sha256 over the app's code and configuration files (names and bytes).

    Only ``SOURCE_SUFFIXES``: what an app writes next to itself (datasets, outputs) is not its identity.
    """
    from .app import _IGNORE

    h = hashlib.sha256()
    root = Path(app_dir)
    for dirpath, dirnames, filenames in os.walk(root):
        ignored = _IGNORE(dirpath, [*dirnames, *filenames])
        dirnames[:] = sorted(d for d in dirnames if d not in ignored)
        for name in sorted(f for f in filenames if f not in ignored and Path(f).suffix in SOURCE_SUFFIXES):
            path = Path(dirpath) / name
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def config_digest(config: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    """sha256 of the run config without operational keys, plus ``extra`` (rule, f, seed given as flags)."""
    doc = {k: repr(v) for k, v in config.items() if k not in OPERATIONAL_KEYS}
    doc.update({f"flag:{k}": repr(v) for k, v in (extra or {}).items() if v is not None})
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def decide(existing: Lineage | None, app: str, config: str, *, has_checkpoints: bool, new_lineage: bool,
           where: str = "the work directory", new_id: str = "") -> Lineage:
    """The lineage to run under; LineageMismatch when resuming would mix experiments."""
    if existing is None:
        return Lineage(new_id if new_lineage else "", app, config)
    if new_lineage:
        return Lineage(new_id, app, config)
    if (existing.app, existing.config) == (app, config):
        return existing
    if not has_checkpoints:  # nothing to protect: the lineage follows the app
        return Lineage(existing.id, app, config)
    what = " and ".join(w for w, a, b in (("app", existing.app, app), ("run config", existing.config, config))
                        if a != b)
    raise LineageMismatch(f"the checkpoints in {where} were trained with another {what} (app {existing.app}, "
                          f"config {existing.config}; now app {app}, config {config}): resume with the same app "
                          "and run config, or pass --new-lineage to train a new model")


def bind(work_dir: Path, app: str, config: str, *, has_checkpoints: bool, new_lineage: bool) -> Lineage:
    """``decide`` against ``work_dir/lineage.json`` and record the outcome."""
    path = Path(work_dir) / LINEAGE_FILE
    existing = None
    if path.exists():
        try:
            d = json.loads(path.read_text())
            existing = Lineage(str(d["id"]), str(d["app"]), str(d["config"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LocalViolation(f"{path} is unusable ({exc}); remove it to start a new lineage") from None
    got = decide(existing, app, config, has_checkpoints=has_checkpoints, new_lineage=new_lineage,
                 where=str(work_dir), new_id=secrets.token_hex(4))
    if got != existing:
        atomic_write(path, got.to_json())
    return got

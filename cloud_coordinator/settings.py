"""What ``fogline coordinator`` tells the ServerApp it supervises.

The user's ServerApp runs in a process the SuperLink spawns, so the
supervisor cannot pass Python objects. It writes ``settings.json`` into its
work directory and names the file in the run config (key
``fogline-settings``, added to the copy of the app it submits and set again
with ``flwr run --run-config``), with ``FOGLINE_SETTINGS`` in the
environment as a fallback. ``RobustStrategy.start`` reads it from the
Grid's run: the user's code changes only the strategy line.
Fields left None keep what the user's ``RobustStrategy(...)`` says.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.errors import LocalViolation
from runtime.files import atomic_write

__all__ = ["Settings", "SETTINGS_KEY", "SETTINGS_ENV", "SETTINGS_FILE", "REPORT_FILE", "FATAL_FILE", "PROGRESS_FILE",
           "RELEASES_DIR", "SUMMARIES_DIR", "settings_for", "key_path"]

SETTINGS_KEY = "fogline-settings"
SETTINGS_ENV = "FOGLINE_SETTINGS"
SETTINGS_FILE = "settings.json"
REPORT_FILE = "report.json"  # written by the ServerApp when every round is done
FATAL_FILE = "fatal.json"    # written by the ServerApp when bad input stops the run (not worth a restart)
PROGRESS_FILE = "progress.json"  # the ServerApp's heartbeat, every training attempt (the supervisor's watchdog)
RELEASES_DIR = "releases"


def key_path(checkpoint_dir: Path, name: str) -> Path:
    """Where the key that signs (and so verifies) ``checkpoint_dir``'s checkpoints lives: beside it
    in ``<dir>.keys/`` (0700), never inside it: whoever may write the checkpoints must not also
    swap the key that vouches for them. A key an older version left inside moves out (same key:
    the checkpoints it signed still verify)."""
    keys = checkpoint_dir.parent / f"{checkpoint_dir.name}.keys"
    path = keys / name
    old = checkpoint_dir / name
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    if old.is_file() and not path.exists():
        os.replace(old, path)
    return path
SUMMARIES_DIR = "summaries"


@dataclass(frozen=True, slots=True)
class Settings:
    work_dir: str
    checkpoint_dirs: tuple[str, ...] = ()
    quorum: int | None = None
    keep: int = 3
    checkpoint_mode: str = "every-round"
    signing_key: str = ""          # Ed25519 PEM: signs checkpoints and releases
    signer: str = "coordinator"
    rule: str | None = None        # full pipeline, e.g. "nnm+trimmed_mean"
    f: int | None = None
    rounds: int | None = None
    round_timeout: float | None = None
    grace: float | None = None
    min_train_nodes: int | None = None
    min_replies: int | None = None         # usable replies a round needs (None: the rule's minimum for f)
    max_attempts: int | None = None        # attempts per round before the run stops (fatal.json)
    max_round_timeout: float | None = None  # the adapted reply deadline's upper bound
    seed: int | None = None
    export: str = ""               # "package.module:function" from [tool.fogline]
    release_name: str = ""
    release_every: int = 0
    input_shape: tuple[int, ...] | None = None
    supernodes: str = ""           # supernodes.json: authenticated node -> device id (empty: auth off)
    summaries_dir: str = ""
    fog_keys: dict[str, str] = field(default_factory=dict)  # fog id -> Ed25519 public key (hex)
    fog_sites: dict[str, str] = field(default_factory=dict)  # fog id -> its site
    # coordinator site name -> {"summaries_dir", "fog_id", "fog_key" (hex), "fog_site"}: each site's
    # summaries in their own directory, verified under that site's pinned fog key
    sites: dict[str, dict[str, str]] = field(default_factory=dict)
    battery_floor: float = 0.3
    selection: str = "battery-floor"  # selection.RULES; "cross-device": charging, unmetered, idle, cool
    client_evaluate: bool = True   # False: the ClientApp cannot evaluate (none, or a site bridge): send no evaluate
    lineage: str = ""              # lineage.json id: part of the config hash, so a new lineage never resumes an old

    def __post_init__(self) -> None:
        if not self.work_dir:
            raise LocalViolation("settings need a work directory")

    def path(self, name: str) -> Path:
        return Path(self.work_dir) / name

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Settings:
        try:
            d = json.loads(text)
            known = {f.name for f in fields(cls)}
            kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
            if "checkpoint_dirs" in kw:
                kw["checkpoint_dirs"] = tuple(kw["checkpoint_dirs"])
            if kw.get("input_shape") is not None:
                kw["input_shape"] = tuple(int(x) for x in kw["input_shape"])
            return cls(**kw)
        except (ValueError, TypeError, AttributeError) as exc:
            raise LocalViolation(f"unusable coordinator settings ({exc})") from None

    def save(self) -> Path:
        path = self.path(SETTINGS_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self.to_json())
        return path


def settings_for(run_config: Any) -> Settings | None:
    """The settings named by a run config (``grid.run.override_config``) or the environment; None if none."""
    ref = ""
    if isinstance(run_config, dict):
        ref = str(run_config.get(SETTINGS_KEY, "") or "")
    ref = ref or os.environ.get(SETTINGS_ENV, "")
    if not ref:
        return None
    try:
        return Settings.from_json(Path(ref).read_text())
    except OSError as exc:
        raise LocalViolation(f"cannot read coordinator settings {ref}: {exc.strerror or exc}") from None

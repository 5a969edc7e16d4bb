"""The hand-off between a site's two Flower halves on the fog host: jobs in, site aggregates out.

Two-level rounds use Flower at both levels: the cloud's round reaches the
site as a ``train`` Message to the fog's own SuperNode (its ClientApp is
``bridge``), and the site's round runs on the fog's SuperLink as a
long-lived ServerApp (``site_server``) that talks to the site's devices.
Flower has no way for a ClientApp to drive a Grid, so the two meet here, in
a directory on the fog host that only the fog's user can write:

* ``jobs/DEADLINE-ID.job``: the global arrays (names kept, in order) and the round's
  config, with the wall-clock deadline the cloud gave the Message;
* ``done/ID.out``: the site aggregate (or ``None``) with the site's counts
  and rejection reasons.

Every file is written whole (``atomic_write``) and read once; a job past
its deadline is dropped by whoever sees it first; at most ``MAX_JOBS`` wait,
so a stuck site cannot fill the disk. The payload is msgpack with numpy
arrays as raw little-endian bytes (``runtime.codec``'s layout rules: the
dtype and shape are checked on the way back in).
"""
from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from runtime.errors import FoglineError
from runtime.files import atomic_write

__all__ = ["MAX_JOBS", "ConfigValue", "Job", "Outcome", "Spool", "SpoolFull"]

MAX_JOBS = 8
MAX_FILE = 1 << 31                 # 2 GiB: a model bigger than this is not a fog-site model
DONE_TTL_S = 3600.0                # results nobody collected (the bridge died) go after an hour
_ID = re.compile(r"[^A-Za-z0-9_.-]")
_DTYPES = {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}
ConfigValue = int | float | str | bool | bytes | list[Any]


class SpoolFull(FoglineError):
    """Too many jobs wait: the site server is down or stuck."""


def _pack_arrays(names: Sequence[str], arrays: Sequence[np.ndarray]) -> list[list[Any]]:
    out = []
    for name, a in zip(names, arrays, strict=True):
        a = np.ascontiguousarray(a)
        out.append([name, a.dtype.newbyteorder("<").name if a.dtype.kind != "b" else "bool",
                    list(a.shape), a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()])
    return out


def _unpack_arrays(items: Any) -> tuple[list[str], list[np.ndarray]]:
    if not isinstance(items, list):
        raise ValueError("arrays must be a list")
    names, arrays = [], []
    for it in items:
        name, dtype, shape, raw = it
        if dtype not in _DTYPES or not isinstance(raw, bytes):
            raise ValueError(f"array {name!r}: dtype {dtype!r}")
        dt = np.dtype(dtype).newbyteorder("<")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) * dt.itemsize != len(raw):
            raise ValueError(f"array {name!r}: {len(raw)} bytes do not hold {dtype}{list(shape)}")
        names.append(str(name))
        arrays.append(np.frombuffer(raw, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=False))
    return names, arrays


@dataclass(frozen=True, slots=True)
class Job:
    """One cloud round for this site: the global model, its config and how long the cloud waits."""

    job_id: str
    server_round: int
    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]
    config: Mapping[str, Any]
    deadline: float            # wall clock (the cloud's Message TTL, minus a margin)
    created: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The site's answer: its aggregate (None when the site round failed) and what happened."""

    job_id: str
    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...] | None
    examples: float = 0.0                              # examples of the accepted devices
    clients: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)
    failure: str = ""
    seconds: float = 0.0


class Spool:
    """``jobs/`` and ``done/`` under one directory (0700)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.jobs = self.root / "jobs"
        self.done = self.root / "done"
        for d in (self.root, self.jobs, self.done):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    @staticmethod
    def job_id(run_id: int, server_round: int, message_id: str) -> str:
        return _ID.sub("_", f"r{run_id}-{server_round}-{message_id[:24]}")

    # -- the bridge's side
    def submit(self, job: Job) -> None:
        self._drop_expired()
        if len(self._waiting()) >= MAX_JOBS:
            raise SpoolFull(f"{MAX_JOBS} jobs already wait in {self.jobs}: is the site server running?")
        doc = {"id": job.job_id, "round": job.server_round, "config": dict(job.config), "deadline": job.deadline,
               "created": job.created, "arrays": _pack_arrays(job.names, job.arrays)}
        atomic_write(self._job_path(job.job_id, job.deadline), msgpack.packb(doc, use_bin_type=True), mode=0o600)

    def _job_path(self, job_id: str, deadline: float) -> Path:
        return self.jobs / f"{int(deadline * 1000):015d}-{job_id}.job"  # name order is deadline order

    def _waiting(self) -> list[Path]:
        return sorted(p for p in self.jobs.iterdir() if p.suffix == ".job")

    def wait(self, job: Job, poll_s: float = 0.1) -> Outcome | None:
        """The outcome of ``job`` (read once, then removed), or None at its deadline (the job is withdrawn)."""
        path = self.done / f"{job.job_id}.out"
        while time.time() < job.deadline:
            if path.exists():
                try:
                    return self._read_outcome(path)
                finally:
                    path.unlink(missing_ok=True)
            time.sleep(poll_s)
        self._job_path(job.job_id, job.deadline).unlink(missing_ok=True)
        return None

    # -- the site server's side
    def take(self) -> Job | None:
        """The oldest job still in time (removed from the spool), or None; expired and broken jobs are dropped."""
        self._drop_expired()
        for path in self._waiting():
            try:
                job = self._read_job(path)
            except (OSError, ValueError, TypeError, KeyError, msgpack.ExtraData, msgpack.FormatError,
                    msgpack.StackError) as exc:
                job = None
                _warn(f"dropped unreadable job {path.name}: {exc}")
            path.unlink(missing_ok=True)
            if job is not None and job.deadline > time.time():
                return job
        return None

    def finish(self, out: Outcome) -> None:
        doc = {"id": out.job_id, "examples": out.examples, "clients": list(out.clients),
               "accepted": list(out.accepted), "rejected": dict(out.rejected), "failure": out.failure,
               "seconds": out.seconds,
               "arrays": None if out.arrays is None else _pack_arrays(out.names, out.arrays)}
        atomic_write(self.done / f"{out.job_id}.out", msgpack.packb(doc, use_bin_type=True), mode=0o600)

    # -- files
    @staticmethod
    def _load(path: Path) -> dict[str, Any]:
        if path.stat().st_size > MAX_FILE:
            raise ValueError(f"{path.name} is larger than {MAX_FILE} bytes")
        doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=True)
        if not isinstance(doc, dict):
            raise ValueError("not a map")
        return doc

    def _read_job(self, path: Path) -> Job:
        doc = self._load(path)
        names, arrays = _unpack_arrays(doc["arrays"])
        cfg = doc["config"]
        if not isinstance(cfg, dict):
            raise ValueError("config must be a map")
        return Job(str(doc["id"]), int(doc["round"]), tuple(names), tuple(arrays), cfg, float(doc["deadline"]),
                   float(doc["created"]))

    def _read_outcome(self, path: Path) -> Outcome:
        doc = self._load(path)
        arrays = None
        names: list[str] = []
        if doc["arrays"] is not None:
            names, got = _unpack_arrays(doc["arrays"])
            arrays = tuple(got)
        return Outcome(str(doc["id"]), tuple(names), arrays, float(doc["examples"]), tuple(doc["clients"]),
                       tuple(doc["accepted"]), {str(k): str(v) for k, v in dict(doc["rejected"]).items()},
                       str(doc["failure"]), float(doc["seconds"]))

    def _drop_expired(self) -> None:
        """Jobs past their deadline (the name says it) and results nobody collected for an hour."""
        now = time.time()
        for p in self._waiting():
            try:
                if int(p.name.split("-", 1)[0]) / 1000 <= now:
                    p.unlink(missing_ok=True)
            except ValueError:
                p.unlink(missing_ok=True)
        for p in self.done.iterdir():
            try:
                if now - p.stat().st_mtime > DONE_TTL_S:
                    p.unlink(missing_ok=True)
            except OSError:
                pass


def _warn(text: str) -> None:
    import logging

    logging.getLogger("fogline.site-rounds").warning("%s", text)


def from_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A Flower ConfigRecord as plain msgpack-able values (Flower's value types are exactly these)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, np.generic):
            v = v.item()
        out[str(k)] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def now_deadline(ttl_s: float, created: float, margin_s: float) -> float:
    """Wall-clock deadline of a Message with ``ttl_s`` created at ``created``, ``margin_s`` early (reply time)."""
    return created + max(ttl_s - margin_s, 1.0) if created > 0 else time.time() + max(ttl_s - margin_s, 1.0)


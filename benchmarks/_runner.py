"""``fogline bench NAME|all``: run benchmarks one by one; a failure explains itself.

A benchmark that raises (or exits non-zero) does not end ``all`` with a traceback: its traceback
goes to ``out/bench/logs/NAME.log``, the others still run, and ``out/bench/run.json`` records
every step (done / failed with its one-line reason), marked incomplete. The run ends with one
``error:`` line naming the failed benchmarks, why, and where the logs and the record are.
"""
from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._emit import OUT_DIR

__all__ = ["run_benchmarks", "RUN_FILE"]

RUN_FILE = "run.json"


def _one_line(text: str, limit: int = 300) -> str:
    flat = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _record(out: Path, doc: dict[str, Any]) -> Path:
    from runtime.files import atomic_write

    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_FILE
    atomic_write(path, json.dumps(doc, indent=1, default=str))
    return path


def run_benchmarks(names: Sequence[str], rest: Sequence[str], out: Path = OUT_DIR) -> int:
    """Run ``benchmarks.NAME_bench.main(rest)`` for each name; 0 if all passed, else 1 (130 on Ctrl-C)."""
    logs = out / "logs"
    doc: dict[str, Any] = {"names": list(names), "args": list(rest), "steps": [], "incomplete": True,
                           "status": "running", "logs": str(logs), "started_at": time.time()}
    path = _record(out, doc)
    interrupted = usage = False
    for name in names:
        step: dict[str, Any] = {"name": name, "status": "running", "report": str(out / f"{name}.json")}
        doc["steps"].append(step)
        _record(out, doc)  # a bench killed now leaves a record naming it
        t0 = time.monotonic()
        reason: str | None = None
        try:
            rc = importlib.import_module(f"benchmarks.{name}_bench").main(list(rest))
            if rc:
                reason = f"exit code {rc}"
        except KeyboardInterrupt:
            reason, interrupted = "interrupted", True
        except SystemExit as exc:  # a benchmark's own argument parser, or sys.exit
            if exc.code not in (0, None):
                reason, usage = f"exit code {exc.code}", exc.code == 2
        except Exception as exc:  # noqa: BLE001 - one benchmark's failure must not end `all`
            logs.mkdir(parents=True, exist_ok=True)
            log = logs / f"{name}.log"
            log.write_text("".join(traceback.format_exception(exc)))
            reason = _one_line(f"{type(exc).__name__}: {exc}") + f" (traceback in {log})"
        step.update(status="failed" if reason else "done", took_s=round(time.monotonic() - t0, 2))
        if reason:
            step["error"] = reason
            if len(names) > 1:  # progress of `all`; one benchmark's failure is the one line below
                print(f"bench {name} failed after {step['took_s']:g} s: {reason}", file=sys.stderr)
        if interrupted:
            break
    failed = [s for s in doc["steps"] if s["status"] == "failed"]
    doc.update(incomplete=bool(failed) or len(doc["steps"]) < len(names),
               status="failed" if failed else "done", finished_at=time.time())
    _record(out, doc)
    if failed and usage and len(names) == 1:  # its own parser already said which argument, in one line
        return 2
    if failed:
        what = "; ".join(f"{s['name']}: {s['error']}" for s in failed)
        print(f"error: bench failed ({len(failed)} of {len(names)}: {what}); logs: {logs}; "
              f"record (incomplete): {path}", file=sys.stderr)
        return 130 if interrupted else 1
    return 0

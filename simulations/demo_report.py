"""What the demo tells people and scripts: step lines, a progress bar, and ``OUT/report.json``.

Split from ``simulations.demo`` (issue #31); the demo's steps and its failure injection
(``FOGLINE_DEMO_FAIL_AT``) are named here, where the step lines are written.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .demo_procs import ChildDied, _one_line

__all__ = ["DEMO_REPORT", "FAIL_AT_ENV", "STEPS", "Reporter", "failure_line", "write_report"]

# the demo's steps, in order (the report names the one that failed by these)
STEPS = ("sites", "agents", "deploy", "serve", "re-place", "federated", "rollout")
FAIL_AT_ENV = "FOGLINE_DEMO_FAIL_AT"  # a step name or number: fail there (tests of the failure path)
DEMO_REPORT = "report.json"  # OUT/report.json: written at each step, and in full at the end


class Reporter:
    """Step lines and a progress bar for people; a JSON record for scripts."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.steps: list[dict[str, Any]] = []
        self.on_step: Callable[[], object] | None = None
        try:
            from rich.console import Console

            self.console: Any = Console(stderr=True, highlight=False)
        except ImportError:  # rich is in the [sim] extra
            self.console = None

    def say(self, text: str) -> None:
        if self.quiet:
            return
        stamp = f"[{time.monotonic() - self.t0:6.1f}s]"
        if self.console is not None:
            self.console.print(f"[dim]{stamp}[/dim] {text}")
        else:
            print(f"{stamp} {text}", file=sys.stderr)

    def step(self, name: str, title: str) -> None:
        """Step ``name`` (one of ``STEPS``) begins: the one before is done; the partial report is
        written now, so even a demo killed with SIGKILL leaves one naming the step it was in."""
        now = round(time.monotonic() - self.t0, 2)
        self.finish(now)
        n = STEPS.index(name) + 1
        self.steps.append({"n": n, "name": name, "step": title, "at_s": now, "status": "running"})
        self.say(f"[bold cyan]==> {n}/{len(STEPS)} {title}[/bold cyan]" if self.console
                 else f"==> {n}/{len(STEPS)} {title}")
        if self.on_step is not None:
            self.on_step()
        want = os.environ.get(FAIL_AT_ENV, "")
        if want in (name, str(n)):
            raise RuntimeError(f"failure injected at step {n} ({FAIL_AT_ENV}={want})")

    def finish(self, now: float | None = None) -> None:
        """The running step (if any) is done."""
        if self.steps and self.steps[-1]["status"] == "running":
            now = round(time.monotonic() - self.t0, 2) if now is None else now
            self.steps[-1].update(status="done", took_s=round(now - self.steps[-1]["at_s"], 2))

    def fail(self, error: str) -> dict[str, Any]:
        """The running step failed with ``error`` (one line); returns that step's record."""
        if not self.steps or self.steps[-1]["status"] != "running":
            self.steps.append({"n": 0, "name": "setup", "step": "set up", "at_s": 0.0, "status": "running"})
        self.steps[-1].update(status="failed", error=error,
                              took_s=round(time.monotonic() - self.t0 - self.steps[-1]["at_s"], 2))
        return self.steps[-1]


def _progress(rep: Reporter, total: int, what: str) -> Callable[[int], None]:
    if rep.quiet:
        return lambda n: None
    last = [-1]

    def update(n: int) -> None:
        pct = n * 100 // total
        if pct // 10 != last[0] // 10 or n == total:
            last[0] = pct
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            rep.say(f"  [{bar}] {n}/{total} {what}")

    return update


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted ({exc or 'SIGINT'})"
    if isinstance(exc, (ChildDied, TimeoutError)):
        return _one_line(str(exc), 500)
    return _one_line(f"{type(exc).__name__}: {exc}", 500)


def write_report(out: Path, result: dict[str, Any]) -> Path:
    """``OUT/report.json``, atomically (a reader never sees half of one)."""
    from runtime.files import atomic_write

    path = out / DEMO_REPORT
    atomic_write(path, json.dumps(result, indent=1, default=str))
    return path


def failure_line(result: dict[str, Any]) -> str | None:
    """The one line a failed demo ends with: the step, why, and where its logs and report are."""
    step = result.get("failed_step")
    if not step:
        return None
    where = f"step {step['n']}/{len(STEPS)} ({step['name']})" if step.get("n") else "set-up"
    return f"demo failed at {where}: {step.get('error')}; logs: {result.get('logs')}"

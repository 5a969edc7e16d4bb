"""A demo that fails or is killed at a step still explains itself: one ``error:`` line naming the step,
why and where the logs are; a report (``report.json`` and the plots) of what happened up to then,
marked incomplete with the failed step; and no process of it left running.

Each test stops the demo in one of its first two steps (fog brokers, agents), so it costs seconds,
not the demo's minutes: a failure injected at a step (``FOGLINE_DEMO_FAIL_AT``), a fog broker
killed under the demo while it waits for the agents, and the demo itself killed with SIGKILL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from simulations.demo import Budgets, DemoConfig
from simulations.demo_report import FAIL_AT_ENV, STEPS

from waiting import wait_for

# The demo's first steps start 2 fogs (each with its mosquitto) and 14 agents: seconds on a quiet
# machine, minutes beside CPU hogs. The deadlines are the demo's own bounds for that work
# (simulations.demo.Budgets): they catch a hang, they do not pace the test.
_BUDGETS = Budgets.of(DemoConfig(out=Path()))
STEP_DEADLINE_S = _BUDGETS.fog_start_s + 60.0                  # until the agents step begins
DEPLOY_DEADLINE_S = STEP_DEADLINE_S + _BUDGETS.join_s          # until the deploy step begins
EXIT_DEADLINE_S = 120.0  # stopping 2 fogs, their mosquittos and 14 agents, and drawing the plots
pytestmark = [pytest.mark.integration, pytest.mark.timeout(DEPLOY_DEADLINE_S + 2 * EXIT_DEADLINE_S)]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}:/usr/sbin",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", **extra}


def _start(out: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runtime.cli", "demo", "--out", str(out), "--requests", "20",
                             "--rounds", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(**env))


def _report(out: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads((out / "report.json").read_text())
        return doc
    except (OSError, ValueError):
        return None


def _in_step(out: Path, name: str, proc: subprocess.Popen[str] | None = None) -> dict[str, Any] | None:
    """The partial report once the demo has begun step ``name`` (it writes one at each step); a
    demo that exited before is a failure of the test, with its own last words."""
    if proc is not None and proc.poll() is not None:
        _, stderr = proc.communicate()
        pytest.fail(f"the demo exited ({proc.returncode}) before step {name}: {stderr[-2000:]}")
    doc = _report(out)
    steps = (doc or {}).get("steps") or []
    return doc if any(s["name"] == name for s in steps) else None


def _mentioning(out: Path) -> list[psutil.Process]:
    """Every live process whose command line names the demo's directory (fogs, mosquittos, agents,
    Flower processes all get paths under it)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(out) in a for a in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _collect(proc: subprocess.Popen[str], seen: dict[int, tuple[psutil.Process, str]]) -> bool:
    """Add the demo's current descendants (with their command lines) to ``seen``; True once the demo
    has exited."""
    for p in _descendants(proc.pid):
        try:  # read again each time: a child seen between fork and exec still has its parent's
            seen[p.pid] = (seen.get(p.pid, (p, ""))[0], " ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return proc.poll() is not None


def _survivors(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            continue
    return alive


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _finish(proc: subprocess.Popen[str], out: Path) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _kill_all(_mentioning(out))
        stdout, stderr = proc.communicate()
        pytest.fail(f"the failed demo did not exit within {EXIT_DEADLINE_S:g} s: {stderr[-2000:]}")
    return proc.returncode, stdout, stderr


def _assert_nothing_left(out: Path, seen: list[psutil.Process]) -> None:
    try:  # SIGKILL and PR_SET_PDEATHSIG act at once; the deadline only absorbs a busy scheduler
        wait_for(lambda: not _survivors(seen) and not _mentioning(out), 15, "every child of the demo gone")
    except AssertionError:
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in _survivors(seen) + _mentioning(out)]
        _kill_all(_survivors(seen) + _mentioning(out))
        raise AssertionError(f"processes left behind: {left}") from None


def _assert_failed_report(out: Path, step: str, stderr: str) -> dict[str, Any]:
    n = STEPS.index(step) + 1
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr[-3000:]
    line = lines[0]
    assert f"step {n}/{len(STEPS)} ({step})" in line and str(out / "logs") in line, line
    assert str(out / "report.json") in line, line
    assert "Traceback" not in stderr, stderr[-3000:]
    doc = _report(out)
    assert doc is not None, "no report.json"
    assert doc["ok"] is False and doc["incomplete"] is True and doc["status"] == "failed", doc.get("status")
    assert doc["failed_step"]["name"] == step and doc["failed_step"]["n"] == n, doc["failed_step"]
    assert [s["status"] for s in doc["steps"]] == ["done"] * (n - 1) + ["failed"], doc["steps"]
    assert doc["logs"] == str(out / "logs") and (out / "logs").is_dir()
    for png in ("placement.png", "latency.png", "accuracy.png", "sites.png"):  # plots of what there is
        assert (out / png).stat().st_size > 1000, png
    return doc


def test_a_failure_at_a_step_names_it_writes_the_report_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _start(out, **{FAIL_AT_ENV: "deploy"})  # after the fogs and the 14 agents are up
    found: dict[int, tuple[psutil.Process, str]] = {}
    try:
        wait_for(lambda: _collect(proc, found), DEPLOY_DEADLINE_S + EXIT_DEADLINE_S, "the demo to fail")
        rc, _, stderr = _finish(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 1, stderr[-3000:]
    doc = _assert_failed_report(out, "deploy", stderr)
    assert f"failure injected at step 3 ({FAIL_AT_ENV}=deploy)" in doc["failed_step"]["error"]
    assert len(doc["devices"]) == 14  # what happened before the failure is in the report
    agents = [cmd for _, cmd in found.values() if "edge_agent" in cmd]
    assert len(agents) >= 14, [cmd for _, cmd in found.values()]  # they ran, and were stopped
    _assert_nothing_left(out, [p for p, _ in found.values()])


def test_a_dead_fog_stops_the_wait_at_once_with_its_reason(tmp_path: Path) -> None:
    """The demo waits minutes for agents to join (Budgets.join_s); a fog broker that dies meanwhile is reported
    now, by name, with how it ended, not as a timeout about missing devices."""
    out = tmp_path / "demo"
    proc = _start(out)
    seen: list[psutil.Process] = []
    try:
        wait_for(lambda: _in_step(out, "agents", proc), STEP_DEADLINE_S, "the agents step")
        seen += _descendants(proc.pid)
        fog = next(p for p in seen if "broker" in p.cmdline() and str(out / "fog-store-2") in p.cmdline())
        fog.send_signal(signal.SIGKILL)
        rc, _, stderr = _finish(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 1, stderr[-3000:]
    doc = _assert_failed_report(out, "agents", stderr)
    error = doc["failed_step"]["error"]
    assert error.startswith("fog-store-2 exited (killed by SIGKILL)"), error
    assert str(out / "logs" / "fog-store-2.log") in error and "timed out" not in error, error
    _assert_nothing_left(out, seen)


def test_a_demo_killed_with_sigkill_leaves_a_report_naming_its_step_and_no_process(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _start(out)
    seen: list[psutil.Process] = []
    try:
        wait_for(lambda: _in_step(out, "agents", proc), STEP_DEADLINE_S, "the agents step")
        seen += _descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    doc = _report(out)
    assert doc is not None and doc["incomplete"] is True and doc["status"] == "running"
    assert [s["name"] for s in doc["steps"]] == ["sites", "agents"] and doc["steps"][-1]["status"] == "running"
    assert doc["logs"] == str(out / "logs") and (out / "logs" / "fog-store-1.log").exists()
    assert len(seen) >= 2, [p.pid for p in seen]
    _assert_nothing_left(out, seen)  # every child dies with the demo (PR_SET_PDEATHSIG)


def test_a_demo_stopped_with_sigterm_cleans_up_and_reports_the_step(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _start(out)
    found: dict[int, tuple[psutil.Process, str]] = {}
    try:
        def in_agents() -> dict[str, Any] | None:
            _collect(proc, found)
            return _in_step(out, "agents", proc)

        wait_for(in_agents, STEP_DEADLINE_S, "the agents step")
        _collect(proc, found)
        proc.send_signal(signal.SIGTERM)
        rc, _, stderr = _finish(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, stderr[-3000:]
    doc = _assert_failed_report(out, "agents", stderr)
    assert doc["failed_step"]["error"] == "interrupted (SIGTERM)" and doc["interrupted"] == "SIGTERM"
    _assert_nothing_left(out, [p for p, _ in found.values()])

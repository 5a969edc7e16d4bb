"""The demo's waits watch the children they depend on: a child that dies ends the wait at once
with its own reason (its ``fatal.json``, else the last error line of its log), not a timeout."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from simulations.demo_procs import ChildDied, Processes, _wait, last_error_line
from simulations.demo_report import failure_line

pytestmark = pytest.mark.integration


def _child(procs: Processes, name: str, code: str, **kw: object) -> None:
    procs.start(name, [sys.executable, "-c", code], **kw)  # type: ignore[arg-type]
    procs.procs[name].wait(timeout=30)


def test_a_dead_child_ends_the_wait_with_the_last_error_line_of_its_log(tmp_path: Path) -> None:
    procs = Processes(tmp_path / "logs")
    _child(procs, "agent-1", "print('starting'); raise ValueError('bad token for site store-1')")
    t0 = time.monotonic()
    with pytest.raises(ChildDied) as err:
        _wait("devices to join", lambda: False, 60, poll=0.05, watch=procs.watching("agent-*"))
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert msg.startswith("agent-1 exited (exit code 1): ValueError: bad token for site store-1"), msg
    assert str(tmp_path / "logs" / "agent-1.log") in msg


def test_fatal_json_is_the_reason_when_the_child_wrote_one(tmp_path: Path) -> None:
    procs = Processes(tmp_path / "logs")
    fatal = tmp_path / "ckpt" / "fatal.json"
    fatal.parent.mkdir()
    code = (f"import json, time; open({str(fatal)!r}, 'w').write(json.dumps("
            "{'error': 'unknown aggregation rule nosuch', 'at': time.time()})); raise SystemExit(2)")
    _child(procs, "coordinator", code, fatal=fatal)
    with pytest.raises(ChildDied, match=r"^coordinator exited \(exit code 2\): unknown aggregation rule nosuch"):
        procs.check("coordinator")


def test_a_stale_fatal_json_is_not_the_reason(tmp_path: Path) -> None:
    procs = Processes(tmp_path / "logs")
    fatal = tmp_path / "fatal.json"
    fatal.write_text(json.dumps({"error": "from an earlier run", "at": time.time() - 3600}))
    _child(procs, "coordinator", "import sys; print('error: SuperLink port in use', file=sys.stderr); sys.exit(1)",
           fatal=fatal)
    with pytest.raises(ChildDied, match="error: SuperLink port in use"):
        procs.check("coordinator")


def test_a_child_killed_on_purpose_or_not_watched_is_no_failure(tmp_path: Path) -> None:
    procs = Processes(tmp_path / "logs")
    procs.start("dev-01", [sys.executable, "-c", "import time; time.sleep(60)"])
    procs.kill9("dev-01")
    _child(procs, "other", "raise SystemExit(3)")
    procs.check("dev-*", "fog-*")  # neither raises


def test_a_condition_met_as_the_child_exits_wins(tmp_path: Path) -> None:
    """A coordinator that finished writes its report and exits: that is success, not a death."""
    procs = Processes(tmp_path / "logs")
    _child(procs, "coordinator", "pass")
    calls = iter([None, {"done": True}])
    assert _wait("the report", lambda: next(calls), 60, poll=0.05,
                 watch=procs.watching("coordinator")) == {"done": True}


def test_last_error_line(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("INFO up\nTraceback (most recent call last):\n  File 'x'\nOSError: [Errno 98] in use\nINFO bye\n")
    assert last_error_line(log) == "OSError: [Errno 98] in use"
    log.write_text("INFO one\nINFO two\n")
    assert last_error_line(log) == "INFO two"
    assert last_error_line(tmp_path / "none.log").startswith("(no log")


def test_failure_line_names_step_reason_and_logs() -> None:
    line = failure_line({"failed_step": {"n": 6, "name": "federated", "error": "coordinator exited (exit code 2): x"},
                         "logs": "/o/logs"})
    assert line == "demo failed at step 6/7 (federated): coordinator exited (exit code 2): x; logs: /o/logs"
    assert failure_line({"ok": True}) is None

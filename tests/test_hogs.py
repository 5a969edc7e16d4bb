"""``make test-stress``'s runner must catch a run that leaves a process behind (issue 23)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HOGS = Path(__file__).with_name("hogs.py")
# a double fork into a new session: the classic orphan (as a mosquitto that outlives its fog)
ORPHAN = "import subprocess; subprocess.Popen(['sleep', '300'], start_new_session=True)"


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HOGS), "--hogs", "1", "--", *command], capture_output=True,
                          text=True, timeout=60, cwd=HOGS.parent.parent)


def test_an_orphan_fails_the_run_and_is_killed() -> None:
    done = _run(sys.executable, "-c", ORPHAN)
    assert done.returncode == 3, done.stderr
    found = re.search(r"left behind by the run: pid (\d+): sleep 300", done.stderr)
    assert found, done.stderr
    pid = int(found.group(1))
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive, f"the orphan {pid} is still running"


def test_a_clean_run_passes_with_the_commands_code() -> None:
    assert _run(sys.executable, "-c", "pass").returncode == 0
    failed = _run(sys.executable, "-c", "raise SystemExit(7)")
    assert failed.returncode == 7
    assert "no process left behind" in failed.stderr

"""A bug in the user's ServerApp code ends the run once, in seconds, with ``fatal.json`` and one line.

Real processes: ``fogline coordinator`` starts Flower's SuperLink, ``flwr run`` submits the app and
Flower's SuperExec starts the ServerApp, whose strategy or ``evaluate_fn`` raises. No restart can fix
that, so the coordinator must not resubmit it (it used to: six submissions over three minutes).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.broker import free_port

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

SERVER_APP = '''
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from cloud_coordinator import RobustStrategy
from digits_app.task import build

app = ServerApp()


class Broken(RobustStrategy):
    def configure_train(self, server_round, arrays, config, grid):
        raise RuntimeError("the user's strategy is broken")


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    cls = Broken if "{kind}" == "Broken" else RobustStrategy
    strategy = cls(rule="median", f=0, fraction_evaluate=0.0, min_train_nodes=1,
                   round_timeout=float(rc["round-timeout"]), grace=0.0)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({{"accuracy": {{}}["accuracy"]}})  # a KeyError, as in the issue

    strategy.start(grid=grid, initial_arrays=ArrayRecord(build(rc).get_weights()), num_rounds=2,
                   evaluate_fn=evaluate_fn if "{kind}" == "evaluate_fn" else None)
'''


def _app(root: Path, kind: str) -> Path:
    app = root / "app"
    shutil.copytree(REPO / "examples" / "digits", app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "digits_app" / "server_app.py").write_text(SERVER_APP.format(kind=kind))
    return app


@pytest.mark.parametrize(("kind", "why"), [
    ("Broken", "the ServerApp raised RuntimeError: the user's strategy is broken (server_app.py:"),
    ("evaluate_fn", "the ServerApp raised KeyError: 'accuracy' (server_app.py:"),
])
def test_a_raising_serverapp_ends_in_seconds_with_fatal_json_and_one_line(tmp_path: Path, kind: str,
                                                                         why: str) -> None:
    work = tmp_path / "ck"
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FOGLINE_CACHE_DIR": str(tmp_path / "cache")}
    log = tmp_path / "coordinator.err"
    with open(log, "wb") as err:
        proc = subprocess.Popen([str(VENV_BIN / "fogline"), "coordinator", "--app", str(_app(tmp_path, kind)),
                                 "--checkpoint-dir", str(work), "--superlink", f"127.0.0.1:{free_port()}",
                                 "--no-supernode-auth", "--round-timeout", "2", "--timeout", "120"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    try:
        # events, not wall time (a loaded host may take long to start Flower): the ServerApp's failure is
        # recorded, then the coordinator ends on it, without a second submission in between
        wait_for(lambda: (work / "fatal.json").exists() or proc.poll() is not None, 150,
                 lambda: f"fatal.json or the coordinator's end: {log.read_text(errors='replace')[-2000:]}",
                 interval=0.2)
        rc = proc.wait(60)  # what is left after fatal.json: stopping the Flower parts, never a new attempt
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    stderr = log.read_text(errors="replace")
    assert rc == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr[-3000:]
    assert errors[0].startswith(f"error: {why}"), errors
    assert "Traceback" not in stderr
    fatal = json.loads((work / "fatal.json").read_text())
    assert fatal["error"] == errors[0].removeprefix("error: ")
    assert "Traceback (most recent call last)" in fatal["traceback"]
    # submitted once: no resubmission of a run that can only fail the same way
    assert (work / "flwr-run.log").read_text(errors="replace").count("Successfully started run") == 1

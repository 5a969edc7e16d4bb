"""Before anything starts: run config checked, checkpoints bound to their experiment, no idle evaluate rounds."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_coordinator.app import bundled_app, client_evaluates, load_app
from cloud_coordinator.lineage import (
    LINEAGE_FILE,
    Lineage,
    LineageMismatch,
    app_digest,
    bind,
    config_digest,
    decide,
)
from cloud_coordinator.settings import Settings
from cloud_coordinator.strategy import RobustStrategy
from runtime.broker import free_port

FOGLINE = str(Path(sys.executable).parent / "fogline")


def _coordinator(work: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    r = subprocess.run([FOGLINE, "coordinator", "--checkpoint-dir", str(work), "--superlink",
                        f"127.0.0.1:{free_port()}", "--timeout", "60", *argv], capture_output=True, text=True,
                       timeout=120, check=False)
    return r, time.monotonic() - t0


@pytest.mark.integration
@pytest.mark.parametrize(("run_config", "why"), [
    ('rule="bogus"', "run config: unknown aggregation rule 'bogus'"),
    ("f=-1", "run config: "),
    ("fraction-evaluate=2.0", "run config: fraction-evaluate must be in [0, 1], got 2.0"),
    ("round-timeout=0.0", "run config: round-timeout must be > 0, got 0.0"),
    ('selection="greedy"', "run config: selection must be one of battery-floor, cross-device, got 'greedy'"),
    ("selection=3", "run config: selection must be a name, got 3"),
])
def test_a_bad_run_config_fails_in_seconds_with_one_line_and_fatal_json(tmp_path: Path, run_config: str,
                                                                       why: str) -> None:
    r, took = _coordinator(tmp_path / "ck", "--run-config", run_config)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {why}"), r.stderr
    assert "Traceback" not in r.stderr and took < 30
    assert json.loads((tmp_path / "ck" / "fatal.json").read_text())["error"] == lines[0].removeprefix("error: ")
    assert not (tmp_path / "ck" / "superlink.db").exists()  # nothing was started


@pytest.mark.integration
def test_a_watchdog_shorter_than_a_working_round_is_refused(tmp_path: Path) -> None:
    r, took = _coordinator(tmp_path / "ck", "--round-timeout", "30", "--grace", "2", "--watchdog", "20")
    assert r.returncode == 2 and took < 30
    assert r.stderr.strip() == ("error: --watchdog 20 must exceed round-timeout + grace (32 s): a working round "
                                "waits that long for replies without a word")
    assert not (tmp_path / "ck" / "superlink.db").exists()


# ------------------------------------------------------------------ lineage

@pytest.mark.parametrize(("existing", "has_ck", "new", "want"), [
    (None, False, False, Lineage("", "a", "c")),                      # first run: id "" (config hashes as before)
    (None, True, True, Lineage("n1", "a", "c")),
    (Lineage("", "a", "c"), True, False, Lineage("", "a", "c")),       # the same experiment resumes
    (Lineage("x", "a", "c"), True, False, Lineage("x", "a", "c")),
    (Lineage("", "old", "c"), False, False, Lineage("", "a", "c")),    # no checkpoints: nothing to protect
    (Lineage("", "old", "c"), True, True, Lineage("n1", "a", "c")),    # --new-lineage: a new id
])
def test_decide(existing: Lineage | None, has_ck: bool, new: bool, want: Lineage) -> None:
    assert decide(existing, "a", "c", has_checkpoints=has_ck, new_lineage=new, new_id="n1") == want


@pytest.mark.parametrize(("app", "config", "what"), [("b", "c", "app"), ("a", "d", "run config"),
                                                     ("b", "d", "app and run config")])
def test_resuming_another_experiment_is_refused_in_one_line(app: str, config: str, what: str) -> None:
    with pytest.raises(LineageMismatch) as err:
        decide(Lineage("", "a", "c"), app, config, has_checkpoints=True, new_lineage=False, where="/ck")
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"the checkpoints in /ck were trained with another {what} ")
    assert text.endswith("or pass --new-lineage to train a new model")


def test_digests_follow_code_and_model_config_not_outputs_or_rounds(tmp_path: Path) -> None:
    import shutil

    app = tmp_path / "app"
    shutil.copytree(bundled_app("digits"), app)
    d0 = app_digest(app)
    (app / "data.csv").write_text("1,2\n")                # data the app wrote next to itself
    (app / "__pycache__").mkdir(exist_ok=True)
    (app / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert app_digest(app) == d0
    (app / "digits_app" / "task.py").write_text((app / "digits_app" / "task.py").read_text() + "\n# changed\n")
    assert app_digest(app) != d0
    base = {"lr": 0.1, "num-server-rounds": 3, "round-timeout": 60.0}
    assert config_digest(base) == config_digest({**base, "num-server-rounds": 10, "round-timeout": 5.0})
    assert config_digest(base) != config_digest({**base, "lr": 0.2})
    assert config_digest(base) != config_digest(base, {"rule": "median"})
    assert config_digest(base) == config_digest(base, {"rule": None})


def test_bind_records_and_refuses(tmp_path: Path) -> None:
    first = bind(tmp_path, "a", "c", has_checkpoints=False, new_lineage=False)
    assert first == Lineage("", "a", "c") and json.loads((tmp_path / LINEAGE_FILE).read_text())["app"] == "a"
    with pytest.raises(LineageMismatch):
        bind(tmp_path, "a", "other", has_checkpoints=True, new_lineage=False)
    fresh = bind(tmp_path, "a", "other", has_checkpoints=True, new_lineage=True)
    assert fresh.id and fresh.config == "other"
    assert bind(tmp_path, "a", "other", has_checkpoints=True, new_lineage=False) == fresh  # and it resumes


@pytest.mark.integration
def test_the_coordinator_refuses_to_resume_checkpoints_of_another_run_config(tmp_path: Path) -> None:
    work = tmp_path / "ck"
    work.mkdir()
    spec = load_app(bundled_app("digits"))
    (work / LINEAGE_FILE).write_text(Lineage("", app_digest(spec.dir), "0" * 16).to_json())
    (work / "ckpt-00000002.json").write_text("{}")
    r, took = _coordinator(work, "--lr", "0.5")
    assert r.returncode == 2 and took < 30
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "were trained with another run config" in lines[0] and "--new-lineage" in lines[0]


def test_a_new_lineage_never_resumes_the_old_checkpoints() -> None:
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from cloud_coordinator.layout import Layout

    layout = Layout.of(ArrayRecord({"w": Array(np.zeros(3, np.float32))}))
    s = RobustStrategy("median", f=0)
    before = s.config_hash(layout)
    s.apply_settings(Settings(work_dir="/tmp/unused"))
    assert s.config_hash(layout) == before  # the first lineage keeps the hashes checkpoints already carry
    s.apply_settings(Settings(work_dir="/tmp/unused", lineage="n1"))
    assert s.config_hash(layout) != before


# ------------------------------------------------------------------ evaluate

@pytest.mark.parametrize(("source", "want"), [
    ("app = ClientApp()\n@app.train()\ndef t(m, c): ...\n@app.evaluate()\ndef e(m, c): ...\n", True),
    ("app = ClientApp()\n@app.train()\ndef t(m, c): ...\n", False),
    ("app = ClientApp()\napp.evaluate()(lambda m, c: m)\n", True),
    ("this is not python(", True),  # unknown: keep the app's evaluation
])
def test_client_evaluates(tmp_path: Path, source: str, want: bool) -> None:
    (tmp_path / "m.py").write_text(source)
    assert client_evaluates(tmp_path / "m.py") is want


def test_no_evaluate_messages_to_a_client_app_that_cannot_evaluate() -> None:
    assert load_app(bundled_app("digits")).client_evaluate  # the bundled apps evaluate on clients
    s = RobustStrategy("median", f=0)
    assert s.rounds.fraction_evaluate == 1.0  # Flower's strategies' default
    s.apply_settings(Settings(work_dir="/tmp/unused", client_evaluate=False))
    assert s.rounds.fraction_evaluate == 0.0

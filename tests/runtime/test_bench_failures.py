"""``fogline bench``: a benchmark that fails is one ``error:`` line naming it, why and where its
traceback is; the others still run; ``run.json`` records every step, marked incomplete."""
from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._runner import RUN_FILE, run_benchmarks


@pytest.fixture
def fake_benches() -> Iterator[list[str]]:
    """Three benchmark modules: one passes, one raises, one exits with a code."""
    def ok(argv: list[str]) -> int:
        print(json.dumps({"ok": True}))
        return 0

    def boom(argv: list[str]) -> int:
        raise ValueError("no such device\nsecond line")

    def bad_args(argv: list[str]) -> int:
        raise SystemExit(2)

    mods = {"zz_ok": ok, "zz_boom": boom, "zz_args": bad_args}
    for name, fn in mods.items():
        mod = types.ModuleType(f"benchmarks.{name}_bench")
        mod.main = fn  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
    try:
        yield list(mods)
    finally:
        for name in mods:
            sys.modules.pop(f"benchmarks.{name}_bench", None)


def test_a_failing_benchmark_is_one_line_and_a_record(fake_benches: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert run_benchmarks(["zz_boom", "zz_ok", "zz_args"], [], out=tmp_path) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "2 of 3" in line and "zz_boom: ValueError: no such device | second line" in line, line
    assert "zz_args: exit code 2" in line and f"logs: {tmp_path / 'logs'}" in line, line
    doc = json.loads((tmp_path / RUN_FILE).read_text())
    assert doc["incomplete"] is True and doc["status"] == "failed"
    assert [(s["name"], s["status"]) for s in doc["steps"]] == [
        ("zz_boom", "failed"), ("zz_ok", "done"), ("zz_args", "failed")]
    assert "ValueError: no such device" in (tmp_path / "logs" / "zz_boom.log").read_text()


def test_all_passing_is_a_complete_record(fake_benches: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert run_benchmarks(["zz_ok"], [], out=tmp_path) == 0
    assert "error:" not in capsys.readouterr().err
    doc = json.loads((tmp_path / RUN_FILE).read_text())
    assert doc["incomplete"] is False and doc["status"] == "done" and doc["steps"][0]["status"] == "done"


def test_a_benchmark_argument_error_is_its_own_line_and_exit_2(fake_benches: list[str], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert run_benchmarks(["zz_args"], ["--nosuch"], out=tmp_path) == 2
    assert capsys.readouterr().err == ""  # argparse of the benchmark printed its own error line
    assert json.loads((tmp_path / RUN_FILE).read_text())["steps"][0]["error"] == "exit code 2"

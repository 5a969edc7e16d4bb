"""`fogline coordinator` / `supernodes` / `release` bad input: one line, exit 2, nothing started or lost."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cloud_coordinator.app import bundled_app, load_app, stage
from runtime.cli import main


def _app(tmp: Path, **edit: str) -> Path:
    """A copy of the digits example with pyproject text replaced."""
    dst = tmp / "app"
    shutil.copytree(bundled_app("digits"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    text = (dst / "pyproject.toml").read_text()
    for old, new in edit.items():
        text = text.replace(old, new)
    (dst / "pyproject.toml").write_text(text)
    return dst


@pytest.mark.parametrize("argv, msg", [
    (["--rule", "nope"], "unknown aggregation rule 'nope'"),
    (["--rounds", "0"], "--rounds"),
    (["--superlink", "nohostport"], "HOST:PORT"),
    (["--quorum", "3"], "quorum 3 is larger than the 1 replica directory"),
    (["--no-supernode-auth", "--superlink", "192.0.2.7:9093"], "--no-supernode-auth is refused"),
    (["--app", "/nonexistent/app"], "does not exist"),
    (["--run-config", "nokey=1"], "has no nokey"),
])
def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                              msg: str) -> None:
    assert main(["coordinator", "--checkpoint-dir", str(tmp_path / "ck"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


@pytest.mark.parametrize("edit, msg", [
    ({'serverapp = "digits_app.server_app:app"\n': ""}, "has no ServerApp"),
    ({'serverapp = "digits_app.server_app:app"': 'serverapp = "digits_app.nothere:app"'}, "has no ServerApp"),
    ({"tool.flwr.app": "tool.flwr.other"}, "has no [tool.flwr.app]"),
    ({'export = "digits_app.task:to_onnx"': 'export = "digits_app.task:nothing"'}, "has no function 'nothing'"),
    ({'export = "digits_app.task:to_onnx"': 'export = "not a ref"'}, "must look like"),
])
def test_bad_app_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, str], msg: str) -> None:
    app = _app(tmp_path, **edit)
    assert main(["coordinator", "--app", str(app), "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "ck" / "superlink.db").exists()  # nothing was started


def test_stage_copies_and_overrides(tmp_path: Path) -> None:
    import tomllib

    spec = load_app(bundled_app("digits"))
    assert spec.export == "digits_app.task:to_onnx" and spec.release == "digits"
    dest = stage(spec, tmp_path / "staged", {"lr": 0.5, "num-server-rounds": 4})
    cfg = tomllib.loads((dest / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert cfg["lr"] == 0.5 and cfg["num-server-rounds"] == 4 and cfg["fogline-settings"] == ""
    assert (dest / "digits_app" / "server_app.py").exists()


def test_supernodes_keys_refuse_duplicates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["supernodes", "keygen", "--out", str(tmp_path / "k1")]) == 0
    assert main(["supernodes", "keygen", "--out", str(tmp_path / "k2")]) == 0
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert main(["supernodes", "add", "dev-1", str(tmp_path / "k1" / "supernode.pub"), *ck]) == 0
    capsys.readouterr()
    assert main(["supernodes", "add", "dev-2", str(tmp_path / "k1" / "supernode.pub"), *ck]) == 2
    assert "already authorized for device 'dev-1'" in capsys.readouterr().err
    assert main(["supernodes", "add", "dev-1", str(tmp_path / "k2" / "supernode.pub"), *ck]) == 2
    assert "already has a key" in capsys.readouterr().err
    assert main(["supernodes", "add", "../x", str(tmp_path / "k2" / "supernode.pub"), *ck]) == 2
    assert main(["supernodes", "list", *ck]) == 0
    assert capsys.readouterr().out.startswith("dev-1\t")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("body, msg", [
    ("return b'not onnx'", "export hook output is not a valid ONNX model"),
    ("raise RuntimeError('no exporter here')", "export hook failed: RuntimeError: no exporter here"),
])
def test_export_hook_failing_in_the_serverapp_is_one_line(tmp_path: Path, body: str, msg: str) -> None:
    """The hook imports fine but fails on real arrays: the ServerApp stops before round one, no restart."""
    import subprocess
    import sys

    from runtime.broker import free_port

    app = _app(tmp_path, **{'export = "digits_app.task:to_onnx"': 'export = "digits_app.task:broken"'})
    with open(app / "digits_app" / "task.py", "a") as fh:
        fh.write(f"\n\ndef broken(arrays):\n    {body}\n")
    ck = tmp_path / "ck"
    out = subprocess.run([str(Path(sys.executable).parent / "fogline"), "coordinator", "--app", str(app),
                          "--checkpoint-dir", str(ck), "--superlink", f"127.0.0.1:{free_port()}",
                          "--no-supernode-auth", "--timeout", "120"], capture_output=True, text=True, timeout=150)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and msg in errors[0], out.stderr[-2000:]
    assert not list(ck.glob("ckpt-*")) and not list(ck.glob(".*tmp*")) and not (ck / "releases").exists()

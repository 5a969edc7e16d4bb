"""Finding 13: a remote deploy may not name a path on the fog host (no file read, no existence oracle).

Before: ``"model": "/some/path.onnx"`` in a deploy made the fog broker open that path on its
own disk, and the error told an existing file from a missing one. Now a model is ``zoo:NAME``,
``release:NAME`` or bytes the request uploaded (``file:SHA256``); anything else is refused
with one fixed sentence, whatever the path names. The attacker here is a real, issued
operator who does not use ``fogline deploy`` (which uploads local files) but writes the
request by hand, against ``fogline broker`` started the way the README says.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.broker import find_mosquitto
from runtime.security import sha256_hex
from simulations.local_site import LocalSite

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REPO = Path(__file__).resolve().parents[2]
GENERIC = "model must be zoo:NAME, release:NAME or an uploaded file"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("paths") / "fog").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid ONNX model on this machine, which is also the fog host."""
    from models import zoo
    p = tmp_path_factory.mktemp("host") / "real.onnx"
    p.write_bytes(zoo.build("mlp").SerializeToString())
    return p


def _models(site: LocalSite) -> set[str]:
    d = site.data_dir / "models"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _refusal(c: Any, model: str) -> str:
    """The fog's answer to a hand-written deploy naming ``model`` (it must refuse)."""
    from fog_broker.client import ControlError
    with pytest.raises(ControlError) as exc:
        c.control("deploy", {"workloads": [{"name": "x", "model": model, "source": "d", "sink": "d"}]}, timeout=8)
    return str(exc.value)


def test_host_paths_are_refused_with_one_sentence(site: LocalSite, onnx_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.onnx"
    existing_paths = ["/etc/passwd", str(onnx_file), str(site.data_dir / "fog.key"),
                      str(site.data_dir / "credentials" / "admin" / "signing.key")]
    missing_paths = [str(missing), "/etc/does-not-exist", str(site.data_dir / "nope.key")]
    before = _models(site)
    with site.client() as c:
        errors = {p: _refusal(c, p) for p in existing_paths + missing_paths}
        # the same paths dressed as references: file: takes a SHA-256 of uploaded bytes only
        for p in ["file:/etc/passwd", f"file:{onnx_file}", "file:../../../../etc/passwd",
                  f"file:{sha256_hex(onnx_file.read_bytes())}", "file:" + "0" * 64]:
            errors[p] = _refusal(c, p)
        assert "x" not in {w["name"] for w in c.status()["workloads"]}
    # one sentence for all of them: an existing file cannot be told from a missing one
    assert set(errors.values()) == {next(iter(errors.values()))}, errors
    assert GENERIC in next(iter(errors.values()))
    assert not any(str(tmp_path) in e or "/etc" in e or "No such file" in e for e in errors.values())
    assert _models(site) == before  # nothing copied from the host into the model store


def test_zoo_and_release_names_are_not_paths(site: LocalSite) -> None:
    """The other two schemes are looked up by name: a traversal is an unknown name, not a file."""
    with site.client() as c:
        zoo = _refusal(c, "zoo:../../../../etc/passwd")
        rel = _refusal(c, "release:../../../../etc/passwd")
        assert "unknown zoo model" in zoo
        assert "no release of" in rel
        # the same answer whether the traversal target exists or not
        assert _refusal(c, "zoo:../../../../etc/nope").replace("nope", "passwd") == zoo
        assert _refusal(c, "release:../../../../etc/nope").replace("nope", "passwd") == rel


def test_a_path_is_never_opened(site: LocalSite, tmp_path: Path) -> None:
    """A FIFO blocks whoever opens it for reading: a prompt refusal proves the fog never opened it."""
    fifo = tmp_path / "trap.onnx"
    os.mkfifo(fifo)
    unblocked = threading.Event()

    def release_reader() -> None:  # if the fog did open the FIFO, let it go after the test decided
        unblocked.wait(30)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    t = threading.Thread(target=release_reader, daemon=True)
    t.start()
    try:
        with site.client() as c:
            t0 = time.monotonic()
            err = _refusal(c, str(fifo))
            assert time.monotonic() - t0 < 8
            assert GENERIC in err and err == _refusal(c, str(tmp_path / "not-a-fifo.onnx"))
    finally:
        unblocked.set()
        t.join(5)


def test_uploaded_bytes_still_deploy(site: LocalSite, onnx_file: Path, tmp_path: Path) -> None:
    """The legitimate path: ``fogline deploy`` uploads the local file; zoo models need no file at all."""
    creds = site.issue("deployer")
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps({"name": "uploaded", "model": str(onnx_file), "source": "d", "sink": "d"}))
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "deploy", str(spec), "--broker", site.mqtt,
                          "--credentials", str(creds)], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "workload uploaded version 1 accepted" in out.stdout
    sha = sha256_hex(onnx_file.read_bytes())
    assert f"{sha}.onnx" in _models(site)
    with site.client() as c:
        c.deploy({"name": "zoo", "model": "zoo:mlp", "source": "d", "sink": "d"})
        models = {w["name"]: w["model"] for w in c.status()["workloads"]}
        assert models["uploaded"] == f"file:{sha}" and models["zoo"] == "zoo:mlp"
        c.delete("uploaded")
        c.delete("zoo")
    assert f"{sha}.onnx" not in _models(site)

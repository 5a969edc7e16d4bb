"""Issue 20 finding 2: an uploaded model could read any file the fog can, through ONNX external data.

Before: a weight stored as external data (``data_location = EXTERNAL``, ``location`` =
a path) was resolved against the fog broker's working directory (``/`` under the shipped
systemd unit) when the fog split the model, so the partition carried that file inline and
the model's own inference sent it back. An operator read the site CA private key; a pinned
coordinator, through a release a workload follows, read the fog's signing key. Now model
bytes from an upload or a release are data, never paths: a model with external data is
refused with one line (the control refusal, the release's ``bad model`` count) before
anything is stored, split or run.

The fog runs as the systemd unit runs it, from ``/``; agents enrolled with a token serve the
partitions. The attackers are an issued operator (``fogline deploy`` of a crafted file) and a
pinned coordinator publishing a signed ``ModelRelease`` by hand.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_releases import _issued, publish, release, settle, status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REFUSAL = "external data"


def adder(n: int, *, location: str | None = None, inline: bytes | None = None) -> bytes:
    """``y = x + W`` over uint8[n]: with ``x`` all zeros the answer is ``W`` itself, byte for byte.

    ``W`` is ``inline`` bytes, or external data at ``location`` (offset 0, length ``n``).
    """
    w = TensorProto(name="W", data_type=TensorProto.UINT8, dims=[n])
    if location is None:
        w.raw_data = inline if inline is not None else bytes(n)
    else:
        w.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(n))):
            e = w.external_data.add()
            e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "adder",
                          [helper.make_tensor_value_info("x", TensorProto.UINT8, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.UINT8, [n])], initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    """A secure fog started from ``/`` (the systemd unit's working directory) with a source and a worker."""
    root = tmp_path_factory.mktemp("extdata")
    s = LocalSite(root / "fog", args=["--state-interval", "1", "--startup-wait", "2"])
    here = os.getcwd()
    os.chdir("/")
    agents: subprocess.Popen[bytes] | None = None
    try:
        s.start()
        cam = {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source"}}
        worker = {"id": "w0", "memory": 400_000, "flops": 5e9, "labels": {"role": "worker"}}
        agents = s.spawn_agents([cam, worker], root / "agents", root / "agents.log")
    finally:
        os.chdir(here)
    try:
        with s.client() as c:
            wait_for(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= {"cam", "w0"}, 60,
                     "both agents alive")
        yield s
    finally:
        if agents is not None and agents.poll() is None:
            os.killpg(agents.pid, signal.SIGKILL)
            agents.wait(5)
        s.stop()


def _secrets(site: LocalSite) -> dict[str, bytes]:
    return {"ca.key": (site.data_dir / "pki" / "ca.key").read_bytes(),
            "fog.key": (site.data_dir / "fog.key").read_bytes()}


def _workload(name: str, model: str) -> dict[str, Any]:
    return {"name": name, "model": model, "source": "cam", "sink": "cam", "selectors": {"role": "worker"}}


def _leaked(site: LocalSite, c: Any, name: str, secret: bytes) -> bool:
    """Whether inference through ``name`` answers with ``secret`` (only asked when the fog took the model)."""
    c.wait_running(name, 60)
    out = c.infer(name, {"x": np.zeros(len(secret), np.uint8)}, timeout=10)["y"]
    return bytes(np.asarray(out, np.uint8)) == secret


def _locations(site: LocalSite, tmp: Path) -> dict[str, str]:
    """Ways to name the site CA key from the fog's working directory ``/``."""
    ca = (site.data_dir / "pki" / "ca.key").resolve()
    link = tmp / "innocent.bin"
    link.symlink_to(ca)
    rel = str(ca).lstrip("/")
    return {"relative to /": rel,
            "dot-dot inside": f"tmp/../{rel}",
            "absolute": str(ca),
            "through /proc/self/root": f"proc/self/root/{rel}",
            "a symlink": str(link).lstrip("/")}


def test_an_operator_cannot_read_a_fog_file_through_an_uploaded_model(site: LocalSite, tmp_path: Path) -> None:
    from fog_broker.client import ControlError

    secret = _secrets(site)["ca.key"]
    before_models = {p.name for p in (site.data_dir / "models").iterdir()}
    refusals: dict[str, str] = {}
    leaks: list[str] = []
    with site.client() as c:
        before = c.status()["counters"]
        for i, (how, loc) in enumerate(_locations(site, tmp_path).items()):
            evil = tmp_path / f"evil{i}.onnx"
            evil.write_bytes(adder(len(secret), location=loc))
            try:  # ``fogline deploy`` uploads the local file as a blob
                c.deploy(_workload(f"steal{i}", str(evil)))
            except ControlError as exc:
                refusals[how] = str(exc)
                continue
            try:
                if _leaked(site, c, f"steal{i}", secret):
                    leaks.append(how)
            finally:
                c.delete(f"steal{i}")
        after = c.status()
    assert not leaks, f"inference returned the site CA key ({', '.join(leaks)})"
    assert len(refusals) == 5, refusals
    for how, msg in refusals.items():
        assert "\n" not in msg and REFUSAL in msg, (how, msg)
        assert "ca.key" not in msg and "BEGIN" not in msg, (how, msg)  # no echo of the path or of the file
    assert not {w["name"] for w in after["workloads"]} & {f"steal{i}" for i in range(5)}
    assert after["counters"].get("control.refused", 0) - before.get("control.refused", 0) == 5
    assert {p.name for p in (site.data_dir / "models").iterdir()} == before_models  # nothing stored
    assert "Traceback" not in site.log.read_text(errors="replace")


def test_a_coordinator_cannot_read_the_fog_key_through_a_followed_release(site: LocalSite) -> None:
    secret = _secrets(site)["fog.key"]
    coord = _issued(site, "coord")
    n = len(secret)
    good = (bytes(range(256)) * (n // 256 + 1))[:n]
    st = status(site)
    publish(site, coord, release(coord.signing, "m", 1, adder(n, inline=good)))
    st = settle(site, st["counters"], 1)
    assert st["releases"]["m"]["version"] == 1
    _issued(site, "op", "operator")  # its own identity: settle()'s admin clients would make it stale
    with site.client("op") as c:
        c.deploy(_workload("follow", "release:m"))
        c.wait_running("follow", 60)
        x = np.zeros(n, np.uint8)
        assert bytes(np.asarray(c.infer("follow", {"x": x}, timeout=10)["y"], np.uint8)) == good
        before = c.status()["counters"]
        # the same name, the next version, signed by the pinned coordinator: weights = the fog's key file
        evil = adder(n, location=str((site.data_dir / "fog.key").resolve()).lstrip("/"))
        publish(site, coord, release(coord.signing, "m", 2, evil))
        st = settle(site, before, 1)

        def answer() -> bytes:
            return bytes(np.asarray(c.infer("follow", {"x": x}, timeout=10)["y"], np.uint8))
        if st["releases"]["m"]["version"] == 2:  # the fog took it: wait for the follower to switch
            wait_for(lambda: answer() != good, 30, "the workload following the release switched")
        leaked = answer() == secret
        assert not leaked, "inference returned the fog's signing key"
        assert answer() == good  # the workload still serves release 1
        assert st["releases"]["m"]["version"] == 1, st["releases"]["m"]
        assert st["counters"].get("release:bad model", 0) == before.get("release:bad model", 0) + 1
        c.delete("follow")
    assert "Traceback" not in site.log.read_text(errors="replace")

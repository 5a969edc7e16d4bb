"""A release rollout switches make-before-break: no request fails or is lost while the version changes.

Against ``fogline broker`` started the way the README says (secure: its CA, mosquitto with TLS
and an ACL) and simulated agents enrolled with a token: a coordinator identity publishes a signed
``ModelRelease`` of ``m``; an operator deploys ``follow`` (``release:m``, 2 replicas of 2
partitions each); two app identities stream requests without pause while the coordinator
publishes the next release, which the fog follows by switching ``follow`` to a new version.
Every answer is checked against the monolithic onnxruntime run of the old or the new model,
each stream goes old -> new exactly once, and the old partitions are gone afterwards.
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime import codec
from runtime.broker import find_mosquitto
from runtime.credentials import load_credentials
from runtime.messages import ModelRelease
from runtime.mqtt import MqttClient
from runtime.security import Identity, sign_artifact
from runtime.topics import Topics
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]


def _release(signer: Identity, name: str, version: int, blob: bytes) -> ModelRelease:
    """A release as ``cloud_coordinator.release.build_release`` makes it (the signed metadata names it)."""
    sig = sign_artifact(signer, blob, {"workload": name, "version": str(version), "format": "onnx"})
    return ModelRelease(name, version, sig.sha256, blob, sig.signature, signer.name, dict(sig.metadata))


def _reference(model: Any, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


@dataclass
class Stream:
    """One app identity sending requests back to back; what came back, in order."""

    client: Any
    x: np.ndarray
    answers: list[tuple[float, str, Any]] = field(default_factory=list)  # (sent at, kind, logits | error)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                res = self.client.infer_result("follow", {"x": self.x}, timeout=5.0)
            except TimeoutError as exc:  # no answer at all: a lost request
                self.answers.append((sent, "lost", str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - counted, the test reports it
                self.answers.append((sent, "failed", f"{type(exc).__name__}: {exc}"))
                continue
            if res.ok:
                self.answers.append((sent, "ok", np.asarray(res.tensors["logits"])))
            else:
                self.answers.append((sent, "failed", res.error))


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[LocalSite, list[subprocess.Popen[bytes]]]]:
    s = LocalSite(tmp_path / "fog", site=f"t{uuid.uuid4().hex[:8]}", log=tmp_path / "fog.log", verbose=2,
                  args=["--state-interval", "1", "--startup-wait", "4", "--summary-interval", "1"]).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield s, procs
    finally:
        s.kill()
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait(5)


def test_release_rollout_switches_without_a_failed_request(site: tuple[LocalSite, list[Any]],
                                                           tmp_path: Path) -> None:
    from models import zoo

    fog, procs = site
    t_start = time.monotonic()
    cam = {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pd-cam"}}
    workers = [{"id": f"w{i}", "memory": 400_000, "flops": 5e9,
                "labels": {"role": "worker", "power-domain": f"pd{i}"}} for i in range(4)]
    procs.append(fog.spawn_agents([cam] + workers, tmp_path / "agents", tmp_path / "agents.log"))
    # identities: the coordinator that releases, two apps that stream, the operator (admin)
    for name, role in (("coord", "coordinator"), ("app1", "app"), ("app2", "app")):
        fog.issue(name, role)
    op = fog.client()
    coord = load_credentials(fog.credentials("coord"))
    apps = [fog.client(n) for n in ("app1", "app2")]
    everyone = {"cam", "w0", "w1", "w2", "w3"}
    wait_for(lambda: {d["id"] for d in op.status()["devices"] if d["alive"]} >= everyone, 30,
             "5 agents alive")

    def publish(msg: ModelRelease) -> None:
        c = MqttClient(coord.name, "127.0.0.1", fog.port,
                       tls=coord.tls_for(coord.fog.fog_id))
        c.start()
        try:
            assert c.wait_connected(10), c.last_error
            assert c.publish(Topics(fog.site).release(coord.name), codec.encode(msg), qos=1).wait(10)
        finally:
            c.stop()

    old_model = zoo.build("mlp", hidden=32, seed=1)
    new_model = zoo.build("mlp", hidden=48, seed=2)
    x = np.random.default_rng(7).random((1, 64), dtype=np.float32)
    ref_old, ref_new = _reference(old_model, x), _reference(new_model, x)
    assert not np.allclose(ref_old, ref_new, atol=1e-3)

    publish(_release(coord.signing, "m", 1, old_model.SerializeToString()))
    wait_for(lambda: "m" in op.status()["releases"], 15, "release m v1 accepted")
    op.deploy({"name": "follow", "model": "release:m", "source": "cam", "sink": "cam", "replicas": 2,
               "min_partitions": 2, "selectors": {"role": "worker"}})
    w1 = op.wait_running("follow", 30)
    v1 = w1["version"]
    assert all(len(r["partitions"]) == 2 for r in w1["placement"]), w1
    np.testing.assert_allclose(apps[0].infer("follow", {"x": x}, timeout=5)["logits"], ref_old, rtol=1e-4, atol=1e-5)

    streams = [Stream(c, x) for c in apps]
    threads = [threading.Thread(target=s.run, name=f"stream-{i}", daemon=True) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)  # the old version answers
        t_release = time.monotonic()
        publish(_release(coord.signing, "m", 2, new_model.SerializeToString()))

        views: list[dict[str, Any]] = []  # the switch as ``fogline status`` showed it meanwhile

        def switched() -> Any:
            w = next(w for w in op.status()["workloads"] if w["name"] == "follow")
            if w["switch"] is not None:
                views.append(w["switch"])
            return w if w["version"] > v1 and w["healthy_replicas"] == 2 and w["switch"] is None else None
        w2 = wait_for(switched, 30, "follow switched to the new release, the old partitions gone")
        t_done = time.monotonic()
        time.sleep(1.5)  # the new version answers
    finally:
        for s in streams:
            s.stop.set()
        for t in threads:
            t.join(15)
    st = op.status()
    for c in apps + [op]:
        c.close()

    # ---- what the streams met
    kinds = [kind for s in streams for _, kind, _ in s.answers]
    failed = [(t - t_release, out) for s in streams for t, kind, out in s.answers if kind == "failed"]
    lost = [(t - t_release, out) for s in streams for t, kind, out in s.answers if kind == "lost"]
    total = len(kinds)
    switch_s = t_done - t_release
    print(f"\nrelease switch: {total} requests, {len(failed)} failed, {len(lost)} lost; "
          f"switch (release published -> old partitions gone) {switch_s:.2f} s; "
          f"whole test {time.monotonic() - t_start:.1f} s")
    assert not failed and not lost, (failed[:5], lost[:5])
    for s in streams:
        seen = []
        for _, _, out in s.answers:
            if np.allclose(out, ref_old, rtol=1e-4, atol=1e-5):
                seen.append("old")
            elif np.allclose(out, ref_new, rtol=1e-4, atol=1e-5):
                seen.append("new")
            else:
                raise AssertionError(f"an answer matches neither model: {out}")
        flips = sum(1 for a, b in itertools.pairwise(seen) if a != b)
        assert seen[0] == "old" and seen[-1] == "new" and flips == 1, seen  # old ... old new ... new
    # ---- the fog's side: the switch was shown, the new version runs 2 replicas, nothing old is left
    assert views and all(v["from_version"] == v1 and v["to_version"] == w2["version"] for v in views), views
    assert views[-1]["mode"] == "make-before-break" and views[-1]["reason"] is None, views[-1]
    assert {p["state"] for v in views for p in v["old_partitions"]} >= {"draining"}, views
    assert w2["status"] == "running"
    leftovers = [p for d in st["devices"] for p in d["partitions"] if p.startswith(f"follow/v{v1}/")]
    assert leftovers == [], leftovers
    c = st["counters"]
    assert c.get("router.failed", 0) == 0 and c.get("controller.switches", 0) == 1, c
    assert c.get("controller.retired", 0) == 4, c  # 2 replicas x 2 partitions, each after its drain

"""Finding 9: the data plane was unauthenticated.

Before: an anonymous racer answered 3 of 3 ``fogline infer`` calls with a forged result, and
under the test ACL every device could read ``fog/#`` and write any ``dev/+/ACT`` and ``reply/+``.
Now results are sealed by the fog to ``reply/<name>`` (only the fog writes reply topics and
clients check its key), the fog takes a result only from the last hop of the route it issued,
and a device runs an activation only with the fog's signed route ticket and the previous hop's
signature, once.

The attacker holds a real enrolled device's credentials (a throwaway device enrolled with a
bootstrap token: a valid certificate and device key) and writes MQTT by hand. The victim is a
real agent serving ``zoo:mlp`` on a site started the way the README says.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from edge_agent.testing import FogSigner
from runtime import codec, relay
from runtime.broker import find_mosquitto
from runtime.messages import (
    Activation,
    ControlRequest,
    Hop,
    InferenceRequest,
    InferenceResult,
    Relay,
    Tensors,
)
from runtime.mqtt import Inbound, MqttClient
from runtime.security import Identity, Signer
from runtime.topics import Topics
from simulations.local_site import LocalSite

from _agent_harness import REPO, kill, wait_status
from _agent_harness import status as agent_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")
DEV, EVIL = "dev-w", "evil"
FOG_REPLY = T.reply("fog-default")


@dataclass
class Plane:
    site: LocalSite
    agent: subprocess.Popen[bytes]
    dev_data: Path
    evil_data: Path
    version: int

    @property
    def evil(self) -> Identity:
        return Identity.load(EVIL, self.evil_data / "agent.key")

    def evil_client(self, subs: dict[str, Any] | None = None) -> MqttClient:
        from edge_agent.credentials import tls_config
        c = MqttClient(EVIL, "127.0.0.1", self.site.port, tls=tls_config(self.evil_data, "fog-default"))
        for topic, handler in (subs or {}).items():
            c.subscribe(topic, handler)
        c.start()
        assert c.wait_connected(10), c.last_error
        return c


def _reference(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from models import zoo
    sess = ort.InferenceSession(zoo.build("mlp").SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def _watch(site: LocalSite) -> dict[str, Any]:
    """Status through an operator of its own, so the admin's connection is never taken over."""
    from fog_broker.client import FogClient
    with FogClient("127.0.0.1", site.port, credentials=site.credentials("watch")) as c:
        return c.status()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    from edge_agent.enrol import enrol_dirs
    root = tmp_path_factory.mktemp("plane")
    site = LocalSite(root / "fog").start()
    proc = None
    try:
        site.issue("watch")
        dev_data = root / DEV
        with open(root / f"{DEV}.log", "wb") as log:
            # a long keepalive: the tests SIGSTOP the agent for a moment to hold a request in flight
            proc = subprocess.Popen(site.agent_argv(DEV, dev_data, "--threads", "1", "--keepalive", "20"),
                                    cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
        wait_status(dev_data, lambda s: s.get("phase") == "online", timeout=40)
        with site.client() as c:
            c.deploy({"name": "w", "model": "zoo:mlp", "source": DEV, "sink": DEV})
            w = c.wait_running("w", 40)
        enrol_dirs(site.token(), [(EVIL, root / EVIL)], "127.0.0.1", int(site.enroll.rsplit(":", 1)[1]),
                   timeout_s=30)
        yield Plane(site, proc, dev_data, root / EVIL, int(w["version"]))
    finally:
        if proc is not None:
            kill(proc)
        site.stop()


class Stopped:
    """SIGSTOP the victim agent for a moment: the fog's attempt stays pending (well under its liveness)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def __enter__(self) -> Stopped:
        os.kill(self.proc.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


def _pending_infer(c: Any, rid: str, x: np.ndarray, box: list[Any]) -> threading.Thread:
    """The admin's inference with a request id the attacker is assumed to know (the worst case)."""
    def run() -> None:
        try:
            box.append(c._await(rid, c._seal(InferenceRequest(rid, "w", c.reply_topic, {"x": x}, 10.0)),
                                c.topics.infer(c.client_id), 14.0))
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            box.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _accepted(site: LocalSite) -> int:
    return int(_watch(site)["counters"].get("router.accepted", 0))


def test_legitimate_inference_through_the_real_agent(plane: Plane, tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    with plane.site.client() as c:
        out = c.infer("w", {"x": x}, timeout=10)
    np.testing.assert_allclose(out["logits"], _reference(x), rtol=1e-5, atol=1e-5)
    np.save(tmp_path / "x.npy", x)
    cli = subprocess.run([sys.executable, "-m", "runtime.cli", "infer", "w", str(tmp_path / "x.npy"), "--broker",
                          plane.site.mqtt, "--credentials", str(plane.site.credentials("watch")), "--json",
                          "--timeout", "10"], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert cli.returncode == 0, cli.stderr
    np.testing.assert_allclose(np.array(json.loads(cli.stdout)["outputs"]["logits"]), _reference(x), atol=1e-5)


def test_an_enrolled_device_reads_no_one_else_s_traffic(plane: Plane) -> None:
    got: queue.Queue[Inbound] = queue.Queue()
    e = plane.evil_client({f"{T.base}/#": got.put})
    try:
        first = got.get(timeout=10)  # the subscription works: the retained fog STATE is everyone's
        assert first.topic == T.fog_state()
        x = np.ones((1, 64), np.float32)
        with plane.site.client() as c:
            for _ in range(3):
                c.infer("w", {"x": x}, timeout=10)
        time.sleep(0.5)
    finally:
        e.stop()
    topics = {first.topic}
    while not got.empty():
        topics.add(got.get_nowait().topic)
    allowed = {T.fog_state(), T.time(), T.rebirth(), T.device(EVIL, "CMD")} | {
        T.activation(EVIL, n) for n in ("fog-default", DEV)}
    assert topics <= allowed, f"an enrolled device read {sorted(topics - allowed)}"


def test_an_enrolled_device_cannot_answer_someone_else_s_inference(plane: Plane) -> None:
    x = np.random.default_rng(2).standard_normal((1, 64)).astype(np.float32)
    forged = {"logits": np.full((1, 10), 42.0, np.float32)}
    evil = plane.evil
    impostor = Identity(DEV, evil._key)  # the evil key, the victim's name
    box: list[Any] = []
    with plane.site.client() as c:
        rid = uuid.uuid4().hex
        base = _watch(plane.site)["counters"]
        with Stopped(plane.agent):
            t = _pending_infer(c, rid, x, box)
            wait_for(lambda: _accepted(plane.site) > base.get("router.accepted", 0), 10, "request pending")
            e = plane.evil_client()
            try:
                res = InferenceResult(f"{rid}#1", True, forged, "", DEV, 0, 0.001)
                # its own result topic (the one it may write), and the ones it may not: the victim's,
                # the fog's without a sender (the old layout), the admin's reply topic
                for topic in (T.result("fog-default", EVIL), T.result("fog-default", DEV), FOG_REPLY,
                              c.reply_topic):
                    e.publish(topic, Signer(evil, 0).seal_bytes(res, time.time()), qos=1).wait(5)      # as itself
                    e.publish(topic, Signer(impostor, 0).seal_bytes(res, time.time()), qos=1).wait(5)  # as the victim
                    e.publish(topic, codec.encode(res), qos=1).wait(5)                                # unsigned
                    e.publish(topic, codec.encode(replace(res, request_id=rid)), qos=1).wait(5)
            finally:
                e.stop()

            def unsigned(ctr: dict[str, Any]) -> int:  # not an envelope; with tensors, over its array budget
                return int(ctr.get("rejected:unsigned", 0)) + int(ctr.get("rejected:malformed", 0))

            def counted() -> dict[str, Any] | None:
                ctr = _watch(plane.site)["counters"]
                return ctr if (ctr.get("router.wrong sender", 0) > base.get("router.wrong sender", 0)
                               and ctr.get("rejected:signer not topic", 0)
                               > base.get("rejected:signer not topic", 0)
                               and unsigned(ctr) >= unsigned(base) + 2) else None
            wait_for(counted, 8, "the fog refused the forged results")
            assert not box  # still waiting for the real answer
        t.join(15)
        assert c.rejected == 0  # nothing but the fog ever wrote to our reply topic
    assert len(box) == 1 and isinstance(box[0], InferenceResult), box
    res = box[0]
    assert res.ok and res.device_id == DEV
    np.testing.assert_allclose(res.tensors["logits"], _reference(x), rtol=1e-5, atol=1e-5)


def test_results_go_only_to_the_requester(plane: Plane) -> None:
    """An issued identity cannot have the fog send a result to another identity's reply topic."""
    from runtime.credentials import load_credentials
    site = plane.site
    x = np.ones((1, 64), np.float32)
    watch = load_credentials(site.credentials("watch"))
    got: queue.Queue[Inbound] = queue.Queue()
    w = MqttClient("watch", "127.0.0.1", site.port, tls=watch.tls_for("fog-default"))
    w.subscribe(T.reply("watch"), got.put)
    w.start()
    try:
        assert w.wait_connected(10) and w.wait_subscribed(T.reply("watch"), 10)
        with site.client() as c:
            base = c.status()["counters"].get("rejected:reply_to", 0)
            req = InferenceRequest(uuid.uuid4().hex, "w", T.reply("watch"), {"x": x}, 5.0)
            assert c._mqtt.publish(T.infer(c.client_id), c._seal(req)[0], qos=1).wait(5)
            wait_for(lambda: c.status()["counters"].get("rejected:reply_to", 0) > base, 10, "reply_to refused")
            assert c.infer("w", {"x": x}, timeout=10)["logits"].shape == (1, 10)  # its own topic: answered
        time.sleep(0.3)
        assert got.empty(), [m.topic for m in list(got.queue)]
    finally:
        w.stop()


def test_a_stray_refusal_does_not_end_a_pending_inference(plane: Plane) -> None:
    """Finding 2 meets finding 9: an app signing garbage in the admin's name must not make the
    fog tell the admin's client "request refused", which ends every request it is waiting for."""
    from fog_broker.client import FogClient
    site = plane.site
    if not site.credentials("app-d").exists():
        site.issue("app-d", "app")
        FogClient("127.0.0.1", site.port, credentials=site.credentials("app-d")).close()
    from runtime.credentials import load_credentials
    app = load_credentials(site.credentials("app-d"))
    x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
    box: list[Any] = []
    with site.client() as c:
        rid = uuid.uuid4().hex
        base = _accepted(site)
        with Stopped(plane.agent):
            t = _pending_infer(c, rid, x, box)
            wait_for(lambda: _accepted(site) > base, 10, "request pending")
            a = MqttClient(app.name, "127.0.0.1", site.port, tls=app.tls_for(app.fog.fog_id))
            a.start()
            try:
                assert a.wait_connected(10)
                forged = Signer(Identity("admin", app.signing._key), 1)
                req = ControlRequest("x", "status", T.reply("admin"), b"{}")
                assert a.publish(T.control(app.name), forged.seal_bytes(req, time.time()), qos=1).wait(5)
            finally:
                a.stop()
            time.sleep(1.0)
        t.join(15)
    assert len(box) == 1, box
    assert isinstance(box[0], InferenceResult) and box[0].ok, f"the admin's pending inference ended with {box[0]!r}"


def test_an_enrolled_device_cannot_inject_or_replay_activations(plane: Plane) -> None:
    """Frames to the victim's partition: the fog key (read from FOGDIR) only stands in for a frame
    the attacker captured; the attacker's own key signs everything else."""
    fog = FogSigner("fog-default", "default", identity=Identity.load("fog-default", plane.site.data_dir / "fog.key"))
    dev_key = Identity.load(DEV, plane.dev_data / "agent.key").public_key_bytes
    evil = plane.evil
    x = np.ones((1, 64), np.float32)
    hop = Hop(DEV, "w", plane.version, 0, 0)

    def act(route: tuple[Hop, ...] = (hop,), deadline: float | None = None, n: int = 0) -> Activation:
        return Activation(f"inj-{uuid.uuid4().hex[:8]}", "w", route, n, FOG_REPLY, {"x": x},
                          time.time() + 30 if deadline is None else deadline)

    keys = {DEV: dev_key, EVIL: evil.public_key_bytes, "dev-x": Identity.generate("dev-x").public_key_bytes}
    as_fog = Identity("fog-default", evil._key)  # the attacker's key under the fog's name
    mine = Hop(EVIL, "w", plane.version, 0, 0)  # the attacker as the hop before the victim's
    after_me = (mine, hop)
    # The attacker may write only dev/{DEV}/ACT/{EVIL}: frames sealed by anyone else (the fog's
    # captured hop 0, another device) are refused there before any check ("wrong sender").
    captured = fog.frame(act(), keys)
    tampered = codec.decode(relay.seal(evil, fog.ticketed(act(route=after_me, n=1), keys)))
    assert isinstance(tampered, Relay)
    frames = {
        "bad ticket signature": relay.seal(evil, FogSigner("fog-default", identity=as_fog).ticketed(
            act(route=after_me, n=1), keys)),
        "wrong sender": relay.seal(evil, fog.ticketed(act(), keys)),  # hop 0 comes from the fog
        "not my hop": relay.seal(evil, fog.ticketed(act(route=(mine, Hop("dev-x", "w", plane.version, 0, 0)),
                                                        n=1), keys)),
        "expired": relay.seal(evil, fog.ticketed(act(route=after_me, n=1, deadline=time.time() - 120), keys)),
    }
    others = [captured, relay.seal(Identity("dev-x", evil._key), fog.ticketed(act(route=(
        Hop("dev-x", "w", plane.version, 0, 0), hop), n=1), keys))]  # sealed by others: not the topic's sender
    altered = codec.encode(replace(tampered, tensors=codec.encode(Tensors({"x": x * 1000}))))
    genuine = relay.seal(evil, fog.ticketed(act(route=after_me, n=1), keys))
    before = wait_status(plane.dev_data, lambda s: "executor" in s)
    deadline = time.monotonic() + 10
    while True:  # the status file is rewritten on the agent's probe tick: wait until it has settled
        time.sleep(1.2)
        now = agent_status(plane.dev_data)
        if now["executor"] == before["executor"] or time.monotonic() > deadline:
            break
        before = now
    answered = before["executor"]["answered"]
    e = plane.evil_client()
    try:
        for frame in [*frames.values(), *others, altered, genuine, genuine]:
            assert e.publish(T.activation(DEV, EVIL), frame, qos=1).wait(5)
        for frame in (captured, genuine):  # the topics of others (and the old one naming no sender): the ACL
            for topic in (T.activation(DEV, "fog-default"), T.activation(DEV, "dev-x"), f"{T.base}/dev/{DEV}/ACT"):
                e.publish(topic, frame, qos=1).wait(5)
    finally:
        e.stop()

    def rejected(s: dict[str, Any], why: str) -> int:
        return int(s["counters"].get(f"rejected activation: {why}", 0)) - int(
            before["counters"].get(f"rejected activation: {why}", 0))
    st = wait_status(plane.dev_data, lambda s: rejected(s, "replayed") >= 1, timeout=15)
    time.sleep(0.5)
    st = agent_status(plane.dev_data)
    expected = {"bad ticket signature": 1, "wrong sender": 1 + 2, "bad signature": 1,  # + 2 sealed by others
                "not my hop": 1, "expired": 1, "replayed": 1}
    assert {why: rejected(st, why) for why in expected} == expected
    assert st["executor"]["answered"] - answered == 1  # the genuine frame ran once, nothing else ran

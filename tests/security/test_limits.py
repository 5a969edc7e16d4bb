"""Finding 15 (fog side): size limits before buffering, uploads checked before storage, status not public.

Before: the 16 MiB cap applied after a message was buffered (a 200 MiB publish took an agent to
680 MB); uploaded blobs were stored before validation and never deleted; ``status`` was readable
by anyone. Now mosquitto has a message size limit, uploads are hashed and checked as ONNX before
anything is written, blobs no workload refers to are deleted, and ``status`` is a signed request
from an issued identity like every other. (The checkpoint parts of finding 15 are the
coordinator's: tests/security/test_coordinator_checkpoints.py.)

Everything runs against ``fogline broker`` started the way the README says (LocalSite), with
identities issued by the site; the attackers write MQTT by hand.
"""
from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import codec
from runtime.broker import _run_dir, find_mosquitto
from runtime.credentials import load_credentials
from runtime.messages import ControlReply, ControlRequest, Envelope
from runtime.mqtt import Inbound, MqttClient, TlsConfig
from runtime.security import Identity, Signer, TrustStore, Verifier, sha256_hex
from runtime.topics import Topics
from simulations.local_site import LocalSite

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REPO = Path(__file__).resolve().parents[2]
T = Topics("default")
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("limits") / "fog").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def device(site: LocalSite, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A throwaway device enrolled with a real token: what an attacker with one Pi holds."""
    from edge_agent.enrol import enrol_dirs
    data = tmp_path_factory.mktemp("evil") / "evil"
    enrol_dirs(site.token(), [("evil", data)], "127.0.0.1", int(site.enroll.rsplit(":", 1)[1]), timeout_s=30)
    return "evil", data


def _connect(name: str, port: int, tls: TlsConfig, subs: dict[str, Any] | None = None, *,
             granted: bool = True) -> MqttClient:
    """Connect; with ``granted``, wait until every subscription is live (else the ACL may refuse them)."""
    c = MqttClient(name, "127.0.0.1", port, tls=tls)
    for topic, handler in (subs or {}).items():
        c.subscribe(topic, handler)
    c.start()
    assert c.wait_connected(10), c.last_error
    for topic in subs or {} if granted else {}:
        assert c.wait_subscribed(topic, 10)
    return c


def _identity(site: LocalSite, name: str, role: str = "operator") -> Any:
    """Issue NAME (``fogline operators add``) and wait until the broker's ACL knows it (one hello)."""
    from fog_broker.client import FogClient
    d = site.credentials(name)
    if not d.exists():
        site.issue(name, role)
        FogClient("127.0.0.1", site.port, credentials=d).close()
    return load_credentials(d)


def _hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _models(site: LocalSite) -> set[str]:
    d = site.data_dir / "models"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


# ---------------------------------------------------------------- (a) the broker's size limit


def test_publish_over_the_limit_never_reaches_a_subscriber(site: LocalSite, device: tuple[str, Path]) -> None:
    """(a) A device may write its own ACT and read it back: over the limit, nothing arrives."""
    from edge_agent.credentials import tls_config
    dev, data = device
    conf = (_run_dir(site.data_dir / "mqtt") / "mosquitto.conf").read_text()
    limit = int(next(ln.split()[1] for ln in conf.splitlines() if ln.startswith("message_size_limit ")))
    assert 16 * MiB < limit <= 32 * MiB  # above the largest legitimate message (a deploy), far below 200 MiB
    got: queue.Queue[Inbound] = queue.Queue()
    c = _connect(dev, site.port, tls_config(data, "fog-default"), {T.activation(dev, "+"): got.put})
    try:
        c.publish(T.activation(dev, dev), b"small", qos=1).wait(5)
        assert got.get(timeout=10).payload == b"small"  # the legitimate path: the subscription works
        c.publish(T.activation(dev, dev), b"\x00" * (limit + MiB), qos=0)
        time.sleep(1.0)
        # disconnected for it is fine too (paho reconnects and resubscribes), as long as nothing arrives:
        # a marker published after it, on the same topic, must be the next thing delivered
        seen: list[int] = []
        for _ in range(10):
            assert c.wait_connected(10) and c.wait_subscribed(T.activation(dev, "+"), 10)
            c.publish(T.activation(dev, dev), b"marker", qos=1).wait(5)
            try:
                while (m := got.get(timeout=2)).payload != b"marker":
                    seen.append(len(m.payload))
                break
            except queue.Empty:
                continue  # the marker went out between a disconnect and the resubscription: again
        else:
            raise AssertionError("no marker came back")
        assert seen == []
    finally:
        c.stop()


def test_oversized_publish_is_refused_before_the_broker_buffers_it(site: LocalSite,
                                                                    device: tuple[str, Path]) -> None:
    """(a) The limit must act on the packet header: an enrolled client must not make mosquitto hold
    a 96 MiB packet in memory to find out it is too large (mosquitto's ``max_packet_size``)."""
    from edge_agent.credentials import tls_config
    dev, data = device
    pid = int(json.loads((site.data_dir / "mqtt" / "owner.json").read_text())["pid"])
    before = _hwm_kb(pid)
    c = _connect(dev, site.port, tls_config(data, "fog-default"))
    try:
        c.publish(T.activation(dev, dev), b"\x00" * (96 * MiB), qos=0)
        time.sleep(3.0)
    finally:
        c.stop()
    grown_mb = (_hwm_kb(pid) - before) / 1024
    assert grown_mb < 40, f"mosquitto's peak RSS grew by {grown_mb:.0f} MB for one refused 96 MiB publish"


# ---------------------------------------------------------------- (b) uploads


def _deploy_blob(c: Any, name: str, model: str, blobs: dict[str, str], **extra: Any) -> str:
    from fog_broker.client import ControlError
    with pytest.raises(ControlError) as exc:
        c.control("deploy", {"workloads": [{"name": name, "model": model, "source": "d", "sink": "d", **extra}],
                             "blobs": blobs}, timeout=20)
    return str(exc.value)


def test_bad_uploads_are_refused_before_anything_is_stored(site: LocalSite) -> None:
    from models import zoo
    valid = zoo.build("mlp").SerializeToString()
    garbage = os.urandom(4096)
    before = _models(site)
    with site.client() as c:
        err = _deploy_blob(c, "junk", f"file:{sha256_hex(garbage)}",
                           {sha256_hex(garbage): base64.b64encode(garbage).decode()})
        assert "not a valid ONNX model" in err
        # valid ONNX under another hash: refused by the hash check, not stored under either name
        other = sha256_hex(b"something else")
        err = _deploy_blob(c, "mismatch", f"file:{other}", {other: base64.b64encode(valid).decode()})
        assert "does not hash to" in err
        err = _deploy_blob(c, "b64", "file:" + "1" * 64, {"1" * 64: "!!not base64!!"})
        assert "not base64" in err
        assert not {"junk", "mismatch", "b64"} & {w["name"] for w in c.status()["workloads"]}
    assert _models(site) == before  # neither the files nor temporary files


def test_a_refused_deploy_leaves_no_uploaded_blob_behind(site: LocalSite) -> None:
    """A valid upload in a deploy the fog then refuses (a bad workload spec) must not stay stored:
    else every refused request leaves up to 24 MiB on the fog's disk until the next deploy."""
    from models import zoo
    valid = zoo.build("mlp", hidden=48).SerializeToString()
    sha = sha256_hex(valid)
    before = _models(site)
    with site.client() as c:
        err = _deploy_blob(c, "nosource", f"file:{sha}", {sha: base64.b64encode(valid).decode()}, source=None)
        assert "source" in err
    assert _models(site) == before, f"left behind: {_models(site) - before}"


def test_blobs_are_deleted_when_nothing_refers_to_them(site: LocalSite) -> None:
    from models import zoo
    keep = zoo.build("mlp", hidden=40).SerializeToString()
    extra = zoo.build("mlp", hidden=24).SerializeToString()
    k, e = sha256_hex(keep), sha256_hex(extra)
    with site.client() as c:
        res = c.control("deploy", {"workloads": [{"name": "kept", "model": f"file:{k}", "source": "d", "sink": "d"}],
                                   "blobs": {k: base64.b64encode(keep).decode(),
                                             e: base64.b64encode(extra).decode()}}, timeout=20)
        assert res["deployed"][0]["name"] == "kept"
        models = _models(site)
        assert f"{k}.onnx" in models and f"{e}.onnx" not in models  # an unreferenced upload is not kept
        c.delete("kept")
        assert f"{k}.onnx" not in _models(site)
        assert c.status()["counters"].get("blobs_collected", 0) >= 2


# ---------------------------------------------------------------- (c) status is not public


def test_status_needs_a_signed_request_from_an_issued_identity(site: LocalSite, device: tuple[str, Path],
                                                               tmp_path: Path) -> None:
    from edge_agent.credentials import tls_config
    from fog_broker.client import ControlError
    op = _identity(site, "snoop")
    fog = Verifier(TrustStore({op.fog.fog_id: op.fog.public_key}))
    got: queue.Queue[Any] = queue.Queue()

    def on_reply(m: Inbound) -> None:
        env = codec.decode(m.payload)
        assert isinstance(env, Envelope) and env.sender == op.fog.fog_id
        got.put(fog.verify_only(env))

    c = _connect(op.name, site.port, op.tls_for(op.fog.fog_id), {T.reply(op.name): on_reply})
    try:
        # unsigned: no answer at all
        c.publish(T.control(op.name), codec.encode(ControlRequest("s1", "status", T.reply(op.name), b"{}")),
                  qos=1).wait(5)
        # signed under the issued name with a key nobody issued: a one-line refusal, no status
        rogue = Signer(Identity.generate(op.name), 1)
        forged = rogue.seal(ControlRequest("s2", "status", T.reply(op.name), b"{}"), time.time())
        c.publish(T.control(op.name), codec.encode(forged), qos=1).wait(5)
        reply = got.get(timeout=10)
        from fog_broker.control import refusal_id
        assert isinstance(reply, ControlReply) and not reply.ok and reply.body == b""
        assert reply.request_id == refusal_id(forged)  # names the refused envelope, never a real request
        assert reply.error.startswith("request refused") and "\n" not in reply.error
        # a signed request with the issued key works on the same connection (the legitimate path)
        good = Signer(op.signing, time.time_ns() // 1_000_000)  # a fresh epoch, as FogClient does
        c.publish(T.control(op.name), good.seal_bytes(ControlRequest("s3", "status", T.reply(op.name), b"{}"),
                                               time.time()), qos=1).wait(5)
        ok = got.get(timeout=10)
        assert isinstance(ok, ControlReply) and ok.ok and ok.request_id == "s3"
        st = json.loads(ok.body)
        assert st["fog_id"] == op.fog.fog_id
        assert st["counters"].get("rejected:unsigned", 0) >= 1
        assert st["counters"].get("control.rejected:bad signature", 0) >= 1
        with pytest.raises(queue.Empty):  # nothing else came back (no answer to the unsigned one)
            got.get(timeout=0.5)
    finally:
        c.stop()
    # a device cannot even ask: the ACL lets devices write no control topic, nor read any reply topic
    dev, data = device
    dev_ident = Identity.load(dev, data / "agent.key")
    seen: queue.Queue[Inbound] = queue.Queue()
    d = _connect(dev, site.port, tls_config(data, "fog-default"), {T.reply(dev): seen.put, T.reply("#"): seen.put},
                 granted=False)
    try:
        d.publish(T.control(dev), Signer(dev_ident, 1).seal_bytes(ControlRequest("s4", "status", T.reply(dev), b"{}"),
                                                               time.time()), qos=1).wait(5)
        with pytest.raises(queue.Empty):
            seen.get(timeout=2.0)
    finally:
        d.stop()
    # an app may infer, not read the site's status
    app = _identity(site, "app-s", "app")
    from fog_broker.client import FogClient
    with (FogClient("127.0.0.1", site.port, credentials=app.dir) as ac,
          pytest.raises(ControlError, match="may not 'status'")):
        ac.status(timeout=10)
    # `fogline status` without credentials prints one error line and no status
    env = {**os.environ, "FOGLINE_CREDENTIALS": str(tmp_path / "none"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "status", "--broker", site.mqtt], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Fog broker:" not in out.stdout and "no credentials directory" in out.stderr
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "status", "--broker", site.mqtt, "--credentials",
                          str(op.dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Fog broker:   fog-default" in out.stdout, out.stderr

"""Session-MAC state adverts end to end: a real edge agent (in this process) and the fog service.

The agent's birth (Ed25519) offers an X25519 key against the fog run's signed offer; its later
state adverts carry HMAC tags and are accepted; a forged tag, a replayed advert and an advert of
an old connection are refused; an agent with ``state_mac=False`` (the default) still signs and
is accepted.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import codec
from runtime.broker import MosquittoBroker, find_mosquitto
from runtime.messages import DeviceState, Envelope
from runtime.mqtt import Inbound, MqttClient
from runtime.security import MAC_LEN, Identity, Signer
from runtime.topics import Topics

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
if find_mosquitto() is None:  # pragma: no cover
    pytest.skip("mosquitto not installed", allow_module_level=True)

SITE = "sess"
T = Topics(SITE)


@pytest.fixture(scope="module")
def broker(mosquitto_module: MosquittoBroker) -> MosquittoBroker:
    return mosquitto_module


@pytest.fixture
def fog(broker: MosquittoBroker, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    from fog_broker.service import FogService, ServiceConfig
    svc = FogService(ServiceConfig(data_dir=tmp_path / "fog", site=SITE, mqtt_port=broker.port,
                                   state_interval_s=0.5, summary_interval_s=5.0,
                                   verify_processes=getattr(request, "param", False))).start()
    yield svc
    svc.stop()


def make(broker: MosquittoBroker, tmp_path: Path, dev_id: str, fog: Any = None, **kw: Any) -> Any:
    """A real agent in this process whose key the fog's operator added (``fogline devices add``)."""
    from edge_agent.agent import AgentConfig, load_identity
    from edge_agent.runner import make_agent
    from simulations.profiles import DeviceProfile
    assert fog is not None
    ident = load_identity(tmp_path / dev_id, dev_id)
    fog.site.add_device(dev_id, ident.public_key_bytes, time.time())
    wait_for(lambda: dev_id in fog.device_keys, 5)
    prof = DeviceProfile(dev_id, flops=5e9, memory_bytes=10_000_000, uplink_bps=1e8, downlink_bps=1e8,
                         rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0)
    cfg = AgentConfig(device_id=dev_id, data_dir=tmp_path / dev_id, host="127.0.0.1", port=broker.port,
                      site=SITE, state_interval_s=0.5, probe_interval_s=0.1, keepalive=5, intra_op_threads=1,
                      status_file=False, fog_key=fog.identity.public_key_bytes, **kw)
    return make_agent(cfg, profile=prof).start()


class Tap:
    """Records the envelopes published on one device's STATE topic."""

    def __init__(self, port: int, dev_id: str) -> None:
        self.raw: list[bytes] = []
        self.client = MqttClient(f"tap-{dev_id}-{time.time_ns()}", "127.0.0.1", port)
        self.client.subscribe(T.device(dev_id, "STATE"), self._on)
        self.client.start()
        assert self.client.wait_connected(5)
        time.sleep(0.1)

    def _on(self, m: Inbound) -> None:
        self.raw.append(m.payload)

    def envelopes(self) -> list[Envelope]:
        return [e for e in (codec.decode(r) for r in self.raw) if isinstance(e, Envelope)]


def accepted_states(svc: Any) -> int:
    return int(svc.ingest.counts()["in:STATE"])


@pytest.mark.parametrize("fog", [False, True], indirect=True, ids=["threads", "processes"])
def test_agent_states_use_session_macs_and_forgeries_are_refused(fog: Any, broker: MosquittoBroker,
                                                                  tmp_path: Path) -> None:
    tap = Tap(broker.port, "mac-1")
    agent = make(broker, tmp_path, "mac-1", fog, state_mac=True)
    try:
        wait_for(lambda: fog.ingest.counts()["session:opened"] >= 1, 30)
        wait_for(lambda: len([e for e in tap.envelopes() if len(e.signature) == MAC_LEN]) >= 2, 30)
        n = accepted_states(fog)
        wait_for(lambda: accepted_states(fog) >= n + 2, 30)
        assert fog.call(lambda: fog.registry.get("mac-1")).state is not None
        assert not {k: v for k, v in fog.rejections().items() if k != "replayed"}
        mac_env = next(e for e in tap.envelopes() if len(e.signature) == MAC_LEN)
        pub = MqttClient(f"forger-{time.time_ns()}", "127.0.0.1", broker.port)
        pub.start()
        assert pub.wait_connected(5)
        topic = T.device("mac-1", "STATE")
        # 1. a forged advert: right device, epoch and a fresh seq, but a tag under a guessed key
        forger = Signer(Identity.generate("mac-1"), agent.epoch, seq=10_000)
        pub.publish(topic, forger.seal_mac_bytes(DeviceState("mac-1", agent.epoch, 10_001, 1), time.time(),
                                                 bytes(32))).wait(2)
        wait_for(lambda: fog.rejections().get("bad signature", 0) >= 1, 30)
        # 2. a captured genuine advert published again
        pub.publish(topic, codec.encode(mac_env)).wait(2)
        wait_for(lambda: fog.rejections().get("replayed", 0) >= 1, 30)
        # 3. the MAC of this connection relabelled with an older epoch does not verify / is stale
        old = Envelope(mac_env.sender, mac_env.epoch - 1, mac_env.seq + 50_000, time.time(), mac_env.payload,
                       mac_env.signature)
        pub.publish(topic, codec.encode(old)).wait(2)
        wait_for(lambda: fog.rejections().get("stale epoch", 0) >= 1, 30,
                 lambda: (fog.ingest.counts(), old))
        pub.stop()
        # the agent keeps being accepted after the forgeries
        n = accepted_states(fog)
        wait_for(lambda: accepted_states(fog) >= n + 1, 30)
    finally:
        agent.stop()
        tap.client.stop()


def test_agent_without_state_mac_still_signs_and_is_accepted(fog: Any, broker: MosquittoBroker,
                                                             tmp_path: Path) -> None:
    tap = Tap(broker.port, "sig-1")
    agent = make(broker, tmp_path, "sig-1", fog, state_mac=False)
    try:
        wait_for(lambda: fog.ingest.counts()["session:none"] >= 1, 30)
        wait_for(lambda: accepted_states(fog) >= 2, 30)
        assert tap.envelopes() and all(len(e.signature) == 64 for e in tap.envelopes())
        assert not fog.rejections()
    finally:
        agent.stop()
        tap.client.stop()


@pytest.mark.parametrize("fog", [False, True], indirect=True, ids=["threads", "processes"])
def test_signed_states_keep_their_replay_window_and_macs_without_session_ask_rebirth(
        fog: Any, broker: MosquittoBroker) -> None:
    from runtime.messages import DeviceBirth
    ident = Identity.generate("raw-1")
    fog.site.add_device("raw-1", ident.public_key_bytes, time.time())
    wait_for(lambda: "raw-1" in fog.device_keys, 5)
    s = Signer(ident, 1)
    pub = MqttClient(f"raw-{time.time_ns()}", "127.0.0.1", broker.port)
    pub.start()
    assert pub.wait_connected(5)
    try:
        birth = DeviceBirth("raw-1", 1, 0, SITE, ident.public_key_bytes, 1e9, 10_000_000, 1e8, 1e8, 0.001, 5.0, 2.0,
                            state_interval_s=5.0)
        pub.publish(T.device("raw-1", "BIRTH"), s.seal_bytes(birth, time.time())).wait(2)
        wait_for(lambda: fog.ingest.counts()["session:none"] >= 1, 30)
        signed = s.seal_bytes(DeviceState("raw-1", 1, 0, 1), time.time())
        pub.publish(T.device("raw-1", "STATE"), signed).wait(2)
        pub.publish(T.device("raw-1", "STATE"), signed).wait(2)  # replayed (window in the shard)
        wait_for(lambda: fog.rejections().get("replayed", 0) >= 1, 30)
        assert accepted_states(fog) == 1
        # a MAC'd state without a session: refused, and the device is asked to rebirth
        pub.publish(T.device("raw-1", "STATE"),
                    s.seal_mac_bytes(DeviceState("raw-1", 1, 0, 1), time.time(), bytes(32))).wait(2)
        wait_for(lambda: fog.rejections().get("no session", 0) >= 1, 30)
        wait_for(lambda: fog.counters["rebirths_asked"] >= 1, 30)
        assert accepted_states(fog) == 1
    finally:
        pub.stop()


def test_looks_mac_is_a_routing_hint_only() -> None:
    from fog_broker._verify_pool import looks_mac
    ident = Identity.generate("h")
    st = DeviceState("h", 1, 0, 1)
    assert looks_mac(Signer(ident, 1).seal_mac_bytes(st, time.time(), bytes(32)))
    assert not looks_mac(Signer(ident, 1).seal_bytes(st, time.time()))
    assert not looks_mac(b"") and not looks_mac(b"garbage")


@pytest.mark.parametrize("fog", [False, True], indirect=True, ids=["threads", "processes"])
def test_reconnect_rekeys_and_states_right_after_a_birth_are_accepted(fog: Any, broker: MosquittoBroker) -> None:
    """A birth and the MAC states behind it (often one verify batch) are taken in order, per epoch."""
    from runtime.messages import DeviceBirth
    from runtime.security import SessionKeyPair
    ident = Identity.generate("rk-1")
    fog.site.add_device("rk-1", ident.public_key_bytes, time.time())
    wait_for(lambda: "rk-1" in fog.device_keys, 5)
    fog_pub = fog.session.public_bytes
    pub = MqttClient(f"rk-{time.time_ns()}", "127.0.0.1", broker.port)
    pub.start()
    assert pub.wait_connected(5)
    try:
        for epoch in (1, 2):
            s = Signer(ident, epoch)
            pair = SessionKeyPair()
            key = pair.derive(fog_pub, "rk-1", epoch, pair.public_bytes, fog_pub)
            birth = DeviceBirth("rk-1", epoch, 0, SITE, ident.public_key_bytes, 1e9, 10_000_000, 1e8, 1e8, 0.001,
                                5.0, 2.0, state_interval_s=5.0, session_key=pair.public_bytes,
                                fog_session_key=fog_pub)
            frames = [(T.device("rk-1", "BIRTH"), s.seal_bytes(birth, time.time()))]
            frames += [(T.device("rk-1", "STATE"), s.seal_mac_bytes(DeviceState("rk-1", epoch, 0, k), time.time(), key))
                       for k in range(1, 6)]
            for topic, data in frames:
                pub.publish(topic, data)

            def caught_up(want: int = 5 * epoch) -> bool:  # bound now, in this epoch's iteration
                return accepted_states(fog) >= want

            wait_for(caught_up, 30, lambda: fog.ingest.counts())
        assert fog.ingest.counts()["session:opened"] == 2
        assert not fog.rejections()
    finally:
        pub.stop()

"""Issue 29 low: each stopped fog left ``/var/lib/fogline/mqtt-<hash>/`` behind, with a copy of
the broker's private key. Started as root, mosquitto works in a run dir its own user owns; a
stopped broker now removes it, and its persistence (retained messages, sessions) waits in the
data dir for the next start."""
from __future__ import annotations

import os
import queue
import shutil
import tempfile
from pathlib import Path

import pytest

from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto
from runtime.mqtt import MqttClient

from waiting import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
              pytest.mark.skipif(os.geteuid() != 0, reason="a run dir apart from the data dir is for root only")]


def test_a_stopped_broker_removes_its_run_dir_and_keeps_its_persistence(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(tempfile.mkdtemp(prefix="fogline-rundirs-"))  # the broker user must traverse it
    base.chmod(0o755)
    monkeypatch.setenv("FOGLINE_MQTT_RUNDIR", str(base / "lib"))
    cfg = BrokerConfig(data_dir=tmp_path / "mq", persistence=True)
    started: list[MosquittoBroker] = []
    try:
        b = MosquittoBroker(cfg).start()
        started.append(b)
        run = b.run_dir
        assert run != b.data_dir and run.is_dir()
        pub = MqttClient("pub", b.host, b.port)
        pub.start()
        assert pub.wait_connected(10)
        h = pub.publish("keep/me", b"retained", qos=1, retain=True)
        wait_for(h.is_published, 10, "the retained publish")
        pub.stop()
        b.stop()
        assert not run.exists(), sorted(p.name for p in run.iterdir())
        assert (cfg.data_dir / "mosquitto.db").is_file()

        b2 = MosquittoBroker(cfg).start()
        started.append(b2)
        got: queue.Queue[bytes] = queue.Queue()
        sub = MqttClient("sub", b2.host, b2.port)
        sub.subscribe("keep/#", lambda m: got.put(m.payload))
        sub.start()
        assert sub.wait_connected(10)
        assert got.get(timeout=10) == b"retained"  # persistence came back with the next start
        sub.stop()
        b2.stop()
        assert not run.exists()
    finally:
        for x in started:  # a failed assertion must not leave a broker running
            x.kill()
        shutil.rmtree(base, ignore_errors=True)

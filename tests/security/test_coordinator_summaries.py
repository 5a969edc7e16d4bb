"""Finding 12: fleet summaries were written without a signature check, the fog id joined into a path.

Attack: on the site's MQTT broker, publish retained summaries that are unsigned, sealed by
an attacker's key under the fog's name, or signed by the real fog but naming
``../../escape/pwned`` or an absolute path as fog id. Now the coordinator's fog link
verifies each against the fog key pinned in its credentials before anything is
written, and files are named by a hash: nothing lands outside the summaries
directory and only the real fog's summary is read back.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from cloud_coordinator.foglink import FogLink
from cloud_coordinator.summaries import read_summaries, summary_path
from runtime import codec
from runtime.mqtt import MqttClient
from runtime.topics import Topics

from _coordinator import FogSigner, make_credentials, summary
from waiting import wait_for

pytestmark = pytest.mark.integration


def test_forged_summaries_write_nothing_and_the_real_one_is_kept(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fog = FogSigner("fog-a", "lab")
    creds = make_credentials(tmp_path / "creds", "coord-1", fog)
    work = tmp_path / "work"
    link = FogLink.connect(mosquitto.address, creds, work, insecure=True)
    link.start()
    attacker = FogSigner("fog-a", "lab")  # same name, another key
    rogue = FogSigner("../../escape/pwned", "lab")
    pub = MqttClient("attacker", mosquitto.host, mosquitto.port)
    pub.start(wait_s=5)
    topic = Topics("lab").summary()
    try:
        attacks = [
            codec.encode(summary(fog)),                                               # unsigned
            attacker.signer.seal_bytes(summary(fog), time.time()),                    # attacker's key
            rogue.signer.seal_bytes(summary(rogue), time.time()),                     # unknown sender, evil id
            fog.signer.seal_bytes(summary(fog, fog_id="../../escape/pwned"), time.time()),  # real key, evil id
            fog.signer.seal_bytes(summary(fog, fog_id="/tmp/abs"), time.time()),
            fog.signer.seal_bytes(summary(fog, site="other"), time.time()),
            b"\x93garbage",
        ]
        for payload in attacks:
            assert pub.publish(topic, payload, retain=True).wait(5)
        wait_for(lambda: sum(link.refused.values()) >= len(attacks), 10)
        assert link.accepted == 0
        assert not (work / "summaries").exists() or not any((work / "summaries").iterdir())
        assert not (tmp_path / "escape").exists() and not Path("/tmp/abs.summary").exists()
        assert {"sender is not the fog", "bad signature", "summary names another fog", "summary names another site",
                "malformed"} <= set(link.refused)
        # the legitimate path: the real fog's sealed summary is stored under a hashed name and reads back
        assert pub.publish(topic, fog.signer.seal_bytes(summary(fog, ("dev-7",)), time.time()), retain=True).wait(5)
        wait_for(lambda: link.accepted == 1, 10)
        files = list((work / "summaries").iterdir())
        assert files == [summary_path(work / "summaries", "fog-a")] and "fog-a" not in files[0].name
        got = read_summaries(work / "summaries", {"fog-a": fog.public_key}, {"fog-a": "lab"})
        assert [d.device_id for s in got for d in s.devices] == ["dev-7"]
        # an older (replayed) summary never replaces a newer one
        assert pub.publish(topic, fog.signer.seal_bytes(summary(fog, ("old",), ts=1.0), time.time()),
                           retain=True).wait(5)
        wait_for(lambda: link.refused.get("older than the stored summary", 0) == 1, 10)
    finally:
        pub.stop()
        link.stop()


def test_tampered_file_is_not_read_back(tmp_path: Path) -> None:
    fog = FogSigner("fog-a", "lab")
    out = tmp_path / "summaries"
    out.mkdir()
    summary_path(out, "fog-a").write_bytes(FogSigner("fog-a", "lab").signer.seal_bytes(summary(fog), time.time()))
    assert read_summaries(out, {"fog-a": fog.public_key}, {"fog-a": "lab"}) == []


def test_against_the_real_fog_over_tls(tmp_path: Path) -> None:
    """The legitimate path end to end: a `fogline broker` site issues coordinator credentials; over TLS the
    coordinator accepts the fog's sealed summaries and the fog accepts its signed release."""
    import subprocess
    import sys

    local_site = pytest.importorskip("simulations.local_site")
    from models.train import SoftmaxRegression, to_onnx
    from runtime.credentials import load_credentials

    site = local_site.LocalSite(tmp_path / "fog", site="lab", args=["--summary-interval", "1"]).start()
    try:
        creds = load_credentials(site.issue("coord-1", role="coordinator"))
        link = FogLink.connect(site.mqtt, creds, tmp_path / "coord")
        link.start()
        try:
            wait_for(lambda: link.accepted >= 1, 20)
            assert not link.refused
        finally:
            link.stop()
        model = tmp_path / "m.onnx"
        model.write_bytes(to_onnx(SoftmaxRegression().get_weights(), batch=1).SerializeToString())
        out = subprocess.run([sys.executable, "-m", "runtime.cli", "release", str(model), "--name", "digits",
                              "--broker", site.mqtt, "--credentials", str(creds.dir), "--version", "3"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        client = site.client()
        try:
            wait_for(lambda: (client.status().get("releases") or {}).get("digits", {}).get("version") == 3, 15)
            assert client.status()["releases"]["digits"]["signer"] == "coord-1"
        finally:
            client.close()
    finally:
        site.stop()

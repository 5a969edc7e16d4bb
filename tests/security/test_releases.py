"""Finding 8: coordinator releases were trusted on first use per signer name, and retained.

Before: ``mallory-coord`` v999999999 made every later real release "stale" and redeployed the
attacker's model to ``release:`` workloads. Now a release counts only when signed by a
coordinator key pinned on the fog host (``fogline operators add NAME --role coordinator`` or
``fogline broker --coordinator-key NAME=HEX``), each release name stays bound to its first
signer, versions only move forward, and releases are not retained by the broker.

The attackers publish ``ModelRelease`` frames by hand on ``cloud/RELEASE`` over the MQTT
connection of an issued coordinator, against ``fogline broker`` started the way the README says.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from runtime import codec
from runtime.broker import find_mosquitto
from runtime.credentials import Credentials, load_credentials
from runtime.messages import ModelRelease
from runtime.mqtt import MqttClient
from runtime.security import Identity, sign_artifact
from runtime.topics import Topics
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")
OUT_OF_BAND = Identity.generate("oob-coord")  # a coordinator whose key the fog was given on its command line


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("rel") / "fog",
                  args=["--coordinator-key", f"oob-coord={OUT_OF_BAND.public_key_bytes.hex()}"]).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    from models import zoo
    return [zoo.build("mlp", hidden=h).SerializeToString() for h in (16, 20, 24, 28, 32)]


def _issued(site: LocalSite, name: str, role: str = "coordinator") -> Credentials:
    from fog_broker.client import FogClient
    if not site.credentials(name).exists():
        site.issue(name, role)
        FogClient("127.0.0.1", site.port, credentials=site.credentials(name)).close()  # ACL loaded
    return load_credentials(site.credentials(name))


def release(signer: Identity, name: str, version: int, blob: bytes) -> ModelRelease:
    """A release as ``cloud_coordinator.release.build_release`` makes it: the signed metadata names it."""
    sig = sign_artifact(signer, blob, {"workload": name, "version": str(version), "format": "onnx"})
    return ModelRelease(name, version, sig.sha256, blob, sig.signature, signer.name, dict(sig.metadata))


def publish(site: LocalSite, carrier: Credentials, *msgs: ModelRelease, retain: bool = False) -> None:
    """Publish over ``carrier``'s own MQTT connection (a coordinator may write cloud/RELEASE/{its name})."""
    c = MqttClient(carrier.name, "127.0.0.1", site.port, tls=carrier.tls_for(carrier.fog.fog_id))
    c.start()
    try:
        assert c.wait_connected(10), c.last_error
        for m in msgs:
            assert c.publish(T.release(carrier.name), codec.encode(m), qos=1, retain=retain).wait(10)
    finally:
        c.stop()


def status(site: LocalSite) -> dict[str, Any]:
    with site.client() as c:
        return c.status()  # type: ignore[no-any-return]


def settle(site: LocalSite, before: dict[str, int], n: int) -> dict[str, Any]:
    """Wait until the fog has decided ``n`` more releases (accepted or refused), return the status."""
    def decided(st: dict[str, Any]) -> int:
        return sum(v for k, v in st["counters"].items() if k == "releases" or k.startswith("release:"))
    want = sum(v for k, v in before.items() if k == "releases" or k.startswith("release:")) + n
    return wait_for(lambda: st if decided(st := status(site)) >= want else None, 20,
                    lambda: f"{n} more release decisions: {status(site)['counters']}", interval=0.2)


def test_only_pinned_coordinators_release(site: LocalSite, blobs: list[bytes]) -> None:
    coord = _issued(site, "coord")
    admin = load_credentials(site.credentials())
    before = status(site)["counters"]
    publish(site, coord,
            release(Identity.generate("rogue-coord"), "m1", 1, blobs[0]),     # a key nobody pinned
            release(Identity.generate("coord"), "m1", 1, blobs[0]),           # an issued name, another key
            release(admin.signing, "m1", 1, blobs[0]))                        # an operator is no coordinator
    st = settle(site, before, 3)
    assert "m1" not in st["releases"]
    c = st["counters"]
    assert c.get("release:signer is not a pinned coordinator", 0) - before.get(
        "release:signer is not a pinned coordinator", 0) == 2
    assert c.get("release:bad signature", 0) - before.get("release:bad signature", 0) == 1
    # the legitimate paths: an issued coordinator, and one pinned with --coordinator-key (any carrier)
    publish(site, coord, release(coord.signing, "m1", 1, blobs[0]), release(OUT_OF_BAND, "m2", 3, blobs[1]))
    st = settle(site, st["counters"], 2)
    assert st["releases"]["m1"]["version"] == 1 and st["releases"]["m1"]["signer"] == "coord"
    assert st["releases"]["m2"]["version"] == 3 and st["releases"]["m2"]["signer"] == "oob-coord"


def test_a_name_stays_with_its_first_signer_and_versions_only_move_forward(site: LocalSite,
                                                                          blobs: list[bytes]) -> None:
    coord = _issued(site, "coord")
    mallory = _issued(site, "mallory-coord")  # pinned too: a coordinator, but not m1's
    st = status(site)
    if "m1" not in st["releases"]:
        publish(site, coord, release(coord.signing, "m1", 1, blobs[0]))
        st = settle(site, st["counters"], 1)
    with site.client() as c:  # an operator's workload that follows the coordinator's m1
        c.deploy({"name": "follow", "model": "release:m1", "source": "d", "sink": "d"})
    model_before = {w["name"]: w["model"] for w in status(site)["workloads"]}["follow"]
    v = st["releases"]["m1"]["version"]
    before = status(site)["counters"]
    publish(site, mallory, release(mallory.signing, "m1", 999_999_999, blobs[2]))   # the old attack
    publish(site, coord, release(coord.signing, "m1", v, blobs[3]))                 # not forward
    st = settle(site, before, 2)
    assert st["releases"]["m1"]["version"] == v and st["releases"]["m1"]["signer"] == "coord"
    assert {w["name"]: w["model"] for w in st["workloads"]}["follow"] == model_before
    assert st["counters"].get("release:stale", 0) - before.get("release:stale", 0) == 1
    assert sum(n for k, n in st["counters"].items() if k.startswith("release:release")) >= 1  # bound to coord
    # the real coordinator's next version is taken, and the workload follows it
    publish(site, coord, release(coord.signing, "m1", v + 1, blobs[4]))
    st = settle(site, st["counters"], 1)
    assert st["releases"]["m1"]["version"] == v + 1
    wait_for(lambda: {w["name"]: w["model"] for w in status(site)["workloads"]}["follow"] != model_before,
             20, "the release:m1 workload to follow the new release", interval=0.2)
    with site.client() as c:
        c.delete("follow")


def test_a_captured_release_cannot_be_relabelled(site: LocalSite, blobs: list[bytes]) -> None:
    """The signature covers the name and version: a real release re-sent under another version
    (or another name) is refused, so a captured release cannot jump every later one to "stale"."""
    coord = _issued(site, "coord")
    mallory = _issued(site, "mallory-coord")
    st = status(site)
    if "m5" not in st["releases"]:
        publish(site, coord, release(coord.signing, "m5", 1, blobs[0]))
        st = settle(site, st["counters"], 1)
    captured = release(coord.signing, "m5", 2, blobs[1])
    publish(site, coord, captured)
    st = settle(site, st["counters"], 1)
    assert st["releases"]["m5"]["version"] == 2
    before = st["counters"]
    publish(site, mallory, replace(captured, version=999_999_999), replace(captured, workload="m6"))
    st = settle(site, before, 2)
    assert st["releases"]["m5"]["version"] == 2, st["releases"]["m5"]
    assert "m6" not in st["releases"], st["releases"].get("m6")
    publish(site, coord, release(coord.signing, "m5", 3, blobs[2]))  # the real next version still counts
    st = settle(site, st["counters"], 1)
    assert st["releases"]["m5"]["version"] == 3


def test_a_signed_release_that_is_not_onnx_is_not_stored(site: LocalSite) -> None:
    """A pinned coordinator's signature does not make bytes a model: checked before they are stored."""
    coord = _issued(site, "coord")
    models = {p.name for p in (site.data_dir / "models").iterdir()}
    before = status(site)["counters"]
    publish(site, coord, release(coord.signing, "junk", 1, b"\x08\x07 not an onnx model" * 100))
    st = settle(site, before, 1)
    assert "junk" not in st["releases"]
    assert st["counters"].get("release:bad model", 0) == before.get("release:bad model", 0) + 1
    assert {p.name for p in (site.data_dir / "models").iterdir()} == models


def test_releases_are_not_retained(site: LocalSite, blobs: list[bytes]) -> None:
    """A release published with the retain flag must not come back to the fog when it restarts."""
    coord = _issued(site, "coord")
    before = status(site)["counters"]
    publish(site, coord, release(coord.signing, "m7", 1, blobs[3]), retain=True)
    st = settle(site, before, 1)
    assert st["releases"]["m7"]["version"] == 1
    site.kill_fog_only()  # a fog crash: its mosquitto keeps running, retained messages and all
    site.start()
    time.sleep(1.0)  # a retained release would be delivered with the subscription, at once
    st = status(site)
    assert st["releases"]["m7"]["version"] == 1  # accepted releases are persisted, not re-learnt
    # (a fog that notices a retained release and clears it may count that; it must decide nothing)
    redelivered = {k: v for k, v in st["counters"].items()
                   if k == "releases" or (k.startswith("release:") and "retain" not in k)}
    assert redelivered == {}, f"a retained release reached the restarted fog: {redelivered}"

"""Issue 20, finding 4: no per-identity rate limit; issue 29: budgets must not quarantine the honest.

Before (issue 20): one enrolled device replaying one signed state 144k times in 25 s made inference
time out and got all three real devices declared dead, and an app identity flooding ``fog/CTL``
stalled another identity's status replies for up to 9.7 s. Every sender got a budget per message
kind, taken before any decode or signature check, and a liveness lane ahead of bulk.

Before (issue 29, on main): 500 messages over budget within 10 s quarantined their sender, and a
quarantine withholds its writes (its states too), so an honest device sending fresh, validly signed
states faster than its budget was shut out and declared lost, and a busy app lost its control
rights. Now traffic past a budget is throttled and counted only; a sender is quarantined (with the
reason in ``fogline status``, its write rights out of the broker's ACL meanwhile) only for frames
that fail their checks: replayed copies, bad signatures, malformed frames.

The site is started the way the README says (TLS, ACL), with three real agents serving
``zoo:mlp``. The attackers hold real credentials (a device enrolled with a bootstrap token, an app
identity from ``fogline operators add``) and are plain paho clients (``_flood``).
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _flood import Probe, alive, attack, device_tls, issued_tls, sent

from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from _agent_harness import REPO, kill, wait_status
from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REAL = ("dev-a", "dev-b", "dev-c")
EVIL, BUSY, APP = "evil", "busy", "app-flood"
FLOOD_S = 10.0


@dataclass
class Site:
    site: LocalSite
    agents: list[subprocess.Popen[bytes]]
    root: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from edge_agent.enrol import enrol_dirs
    root = tmp_path_factory.mktemp("flood-id")
    s = LocalSite(root / "fog").start()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        s.issue("watch")
        s.issue(APP, "app")
        for dev in REAL:
            with open(root / f"{dev}.log", "wb") as log:
                agents.append(subprocess.Popen(
                    s.agent_argv(dev, root / dev, "--threads", "1", "--state-interval", "1",
                                 "--labels", "role=real"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        for dev in REAL:
            wait_status(root / dev, lambda st: st.get("phase") == "online", timeout=60)
        with s.client() as c:
            c.deploy({"name": "w", "model": "zoo:mlp", "source": "dev-a", "sink": "dev-a",
                      "selectors": {"role": "real"}})
            c.wait_running("w", 60)
        enrol_dirs(s.token(uses=2), [(EVIL, root / EVIL), (BUSY, root / BUSY)], "127.0.0.1",
                   int(s.enroll.rsplit(":", 1)[1]), timeout_s=30)
        yield Site(s, agents, root)
    finally:
        for a in agents:
            kill(a)
        s.stop()


def _birth(root: Path, name: str) -> tuple[Any, bytes]:
    """A signer for the device enrolled under ``root / name`` and its signed birth."""
    from runtime.messages import DeviceBirth
    from runtime.security import Identity, Signer
    ident = Identity.load(name, root / name / "agent.key")
    signer = Signer(ident, int(time.time()))
    return signer, signer.seal_bytes(DeviceBirth(name, signer.epoch, 0, "default", ident.public_key_bytes, 1e9,
                                                 1 << 30, 1e8, 1e8, 0.001, 5.0, 2.0, state_interval_s=1.0),
                                     time.time())


def _no_honest_device_lost(probe: Probe) -> None:
    assert not probe.errors, probe.errors[:3]
    assert len(probe.samples) > 5, len(probe.samples)
    dead = [(round(at - probe.samples[0][0], 1), sorted(set(REAL) - alive(st))) for at, _, st in probe.samples
            if not set(REAL) <= alive(st)]
    assert not dead, f"real devices declared dead during the flood (s, ids): {dead[:5]}"
    lost = [e for e in probe.samples[-1][2]["events"] if e["kind"] == "device lost" and e["device"] in REAL]
    assert not lost, lost


def test_an_honest_device_past_its_budget_is_throttled_never_quarantined(site: Site) -> None:
    """Fresh, validly signed states at 25 times the budget: dropped and counted, no more.

    Before: 500 over budget within 10 s quarantined the device and withheld its writes."""
    from runtime.messages import DeviceState
    from runtime.topics import Topics
    t = Topics("default")
    signer, birth = _birth(site.root, BUSY)
    now = time.time()
    states = [(t.device(BUSY, "STATE"), signer.seal_bytes(DeviceState(BUSY, signer.epoch, i, 1 << 29), now))
              for i in range(1, 2_501)]
    with site.site.client("watch") as c:
        wait_for(lambda: set(REAL) <= alive(c.status()), 30, "the three real devices alive")
    with Probe(site.site, "watch", infer=True) as probe:
        probe._stop.wait(1.0)  # a baseline before the flood
        n = sent(attack(site.site.port, site.root, BUSY, device_tls(site.root, BUSY), states, FLOOD_S,
                        once=[(t.device(BUSY, "BIRTH"), birth)], repeat=False, rate=500.0), FLOOD_S)
        probe._stop.wait(4.0)  # and after it: the liveness timeout is 3 missed states of 1 s
    assert n == 2_500
    _no_honest_device_lost(probe)
    with site.site.client("watch") as c:
        last = c.status()
    lim = last["limits"]["devices"]
    assert BUSY not in lim["quarantined"], lim
    assert not any(e["kind"] == "quarantined" and e["device"] == BUSY for e in last["events"]), last["events"]
    assert lim["dropped"].get(BUSY, 0) > 2_000, lim  # throttled and counted
    assert BUSY not in lim.get("failed", {}), lim
    assert last["counters"].get("limited:STATE", 0) >= lim["dropped"][BUSY]


def test_a_device_replaying_and_forging_states_kills_no_one_and_is_quarantined(site: Site) -> None:
    from runtime.messages import DeviceState
    from runtime.topics import Topics
    t = Topics("default")
    signer, birth = _birth(site.root, EVIL)
    now = time.time()
    state = signer.seal_bytes(DeviceState(EVIL, signer.epoch, 1, 1 << 29), now)  # one signed state, replayed
    forged = bytearray(signer.seal_bytes(DeviceState(EVIL, signer.epoch, 2, 1 << 29), now))
    forged[-1] ^= 0xFF  # and one with a bad signature
    frames = [(t.device(EVIL, "STATE"), state), (t.device(EVIL, "STATE"), bytes(forged))]
    with site.site.client("watch") as c:
        wait_for(lambda: set(REAL) <= alive(c.status()), 30, "the three real devices alive")
    with Probe(site.site, "watch", infer=True) as probe:
        n = sent(attack(site.site.port, site.root, EVIL, device_tls(site.root, EVIL), frames, FLOOD_S,
                        once=[(t.device(EVIL, "BIRTH"), birth), (t.device(EVIL, "STATE"), state)]), FLOOD_S)
        probe._stop.wait(5.0)  # and 5 s after it: the liveness timeout is 3 missed states of 1 s
    assert n > 20_000, f"the flood was too slow to prove anything ({n} in {FLOOD_S:g} s)"
    _no_honest_device_lost(probe)
    bad = [r for r in probe.inferences if r[1] != "ok"]
    assert len(probe.inferences) > 10 and not bad, f"{len(bad)} of {len(probe.inferences)} failed: {bad[:3]}"
    last = probe.samples[-1][2]
    lim = last["limits"]["devices"]
    assert EVIL in lim["quarantined"], lim
    assert lim["quarantined"][EVIL]["reason"].startswith("flooding: "), lim
    assert "failed checks" in lim["quarantined"][EVIL]["reason"], lim
    assert lim["failed"][EVIL] >= 10, lim  # checked and failed; its excess counted towards the rest
    ctr = last["counters"]
    assert ctr.get("limited:quarantined", 0) > 0, ctr
    # once quarantined its writes left the ACL: the broker, not the fog, absorbed the rest of the flood
    assert lim["dropped"][EVIL] < 0.5 * n, (lim, n)
    assert any(e["kind"] == "quarantined" and e["device"] == EVIL for e in last["events"]), last["events"]
    assert ctr.get("verify_overflow", 0) == 0 and ctr.get("inbox_overflow", 0) == 0
    assert not set(REAL) & set(lim["quarantined"]), lim
    # fogline status says so in words
    from fog_broker.service_cli import render_status
    assert f"Quarantined:  {EVIL} (devices): flooding: " in render_status(last)


def test_an_app_past_its_control_budget_is_throttled_and_stalls_no_one(site: Site) -> None:
    """Fresh, validly signed requests far past the budget: throttled, others' status unaffected.

    Before: 400 over budget within 10 s quarantined the app (its control rights withheld)."""
    from runtime.credentials import load_credentials
    from runtime.messages import ControlRequest
    from runtime.security import Signer
    from runtime.topics import Topics
    t = Topics("default")
    creds = load_credentials(site.site.credentials(APP))
    signer = Signer(creds.signing, time.time_ns() // 1_000_000)
    now = time.time()
    frames = [(t.control(APP), signer.seal_bytes(ControlRequest(f"r{i}", "hello", t.reply(APP)), now))
              for i in range(5_000)]  # fresh, validly signed requests, each sent once, 50 times the budget
    with Probe(site.site, "watch", period=0.1) as probe:
        probe._stop.wait(2.0)  # a baseline before the flood
        n = sent(attack(site.site.port, site.root, APP, issued_tls(site.site, APP), frames, FLOOD_S,
                        repeat=False, rate=1000.0), FLOOD_S)
        probe._stop.wait(1.0)
    assert n == 5_000
    assert not probe.errors, probe.errors[:3]
    took = sorted(x for _, x, _ in probe.samples)
    assert len(took) > 10, len(took)
    assert took[-1] < 1.0, f"status took up to {took[-1]:.2f} s during the flood (p50 {took[len(took) // 2]:.3f} s)"
    with site.site.client("watch") as c:
        lim = c.status()["limits"]["control"]
    assert APP not in lim["quarantined"], lim
    assert "watch" not in lim["dropped"], lim
    assert lim["dropped"][APP] > 4_000, lim  # throttled and counted

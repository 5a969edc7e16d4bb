"""Enrolment client pieces without a network: token parsing, fog.json, the polling loop, the pinned key."""
from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.agent import Agent, AgentConfig
from edge_agent.credentials import FogInfo, is_enrolled, load_fog_info
from edge_agent.enrol import EnrolError, approve_hint, enrol_all, parse_token
from edge_agent.testing import FogSigner
from runtime.errors import LocalViolation

SHA = "ab" * 32


@pytest.mark.parametrize("text, ok", [
    (f"fgl1.abc123.0123456789abcdef.{SHA}", True),
    (f"  fgl1.abc123.0123456789abcdef.{SHA}\n", True),
    (f"fgl2.abc123.0123456789abcdef.{SHA}", False),
    (f"fgl1.ABC123.0123456789abcdef.{SHA}", False),
    (f"fgl1.abc12.0123456789abcdef.{SHA}", False),
    ("fgl1.abc123.0123456789abcdef.abcd", False),
    ("", False),
])
def test_parse_token(text: str, ok: bool) -> None:
    if ok:
        t = parse_token(text)
        assert (t.id, t.secret, t.ca_sha256) == ("abc123", "0123456789abcdef", SHA)
        assert t.secret not in repr(t)
    else:
        with pytest.raises(EnrolError, match="not a Fogline bootstrap token"):
            parse_token(text)


@pytest.mark.parametrize("obj, error", [
    ({"fog_id": "f", "site": "s", "public_key": "00" * 32}, None),
    ({"fog_id": "f", "site": "s", "public_key": "00" * 31}, "public_key"),
    ({"fog_id": "f", "site": "s", "public_key": "zz"}, "hex"),
    ({"fog_id": "f", "public_key": "00" * 32}, "missing"),
    (["not", "an", "object"], "object"),
])
def test_fog_info_from_json(obj: object, error: str | None) -> None:
    if error is None:
        info = FogInfo.from_json(obj)
        assert FogInfo.from_json(info.to_json()) == info
    else:
        with pytest.raises(ValueError, match=error):
            FogInfo.from_json(obj)


def test_unusable_fog_json_is_a_local_error(tmp_path: Path) -> None:
    assert load_fog_info(tmp_path) is None and not is_enrolled(tmp_path)
    (tmp_path / "fog.json").write_text("{")
    with pytest.raises(LocalViolation, match="enrol again"):
        load_fog_info(tmp_path)


class FakeRequest:
    """An Enrolment stand-in: answers from a script (a float: pending; None: approved; an exception)."""

    def __init__(self, device_id: str, script: list[float | Exception | None]) -> None:
        self.device_id = device_id
        self.script = script
        self.pending = False
        self.polls: list[float] = []

    def poll(self) -> float | None:
        self.polls.append(CLOCK[0])
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        self.pending = self.pending or step is not None
        return step


CLOCK = [0.0]


def _run(reqs: list[FakeRequest], timeout: float) -> list[str]:
    CLOCK[0] = 0.0
    told: list[str] = []

    def sleep(s: float) -> None:
        CLOCK[0] += s

    enrol_all(reqs, timeout, notify=told.append, clock=lambda: CLOCK[0], sleep=sleep)  # type: ignore[arg-type]
    return told


def test_enrol_all_polls_each_request_until_approved_and_tells_once() -> None:
    a, b = FakeRequest("a", [2.0, 2.0, None]), FakeRequest("b", [None])
    assert _run([a, b], 600) == [approve_hint("a")]
    assert a.polls == [0.0, 2.0, 4.0] and b.polls == [0.0]


def test_enrol_all_gives_up_at_the_deadline() -> None:
    a = FakeRequest("a", [5.0] * 10)
    with pytest.raises(EnrolError, match=r"still not approved after 12 s \(a\).*devices approve a"):
        _run([a], 12)
    assert a.polls == [0.0, 5.0, 10.0, 12.0]  # one last try at the deadline


def test_enrol_all_stops_at_the_first_refusal() -> None:
    a = FakeRequest("a", [1.0, EnrolError("token rejected: expired")])
    with pytest.raises(EnrolError, match="token rejected: expired"):
        _run([a], 60)


def test_agent_without_a_pinned_fog_key_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(LocalViolation, match=r"not enrolled.*--token"):
        Agent(AgentConfig("dev-x", tmp_path / "x"), probe=None)  # type: ignore[arg-type]
    assert not (tmp_path / "x" / "fog.json").exists()


def test_agent_pins_the_key_from_fog_json(tmp_path: Path) -> None:
    from edge_agent.simulated import SimulatedDevice
    from runtime.security import Identity
    from simulations.profiles import PROFILES

    fog = FogSigner("fog-1")
    d = tmp_path / "y"
    d.mkdir()
    (d / "fog.json").write_text(
        f'{{"fog_id": "fog-1", "site": "default", "public_key": "{fog.public_key.hex()}"}}')
    agent = Agent(AgentConfig("dev-y", d), SimulatedDevice(PROFILES["pi4"]))
    assert agent.fog_key == fog.public_key
    explicit = Identity.generate("op").public_key_bytes
    assert Agent(AgentConfig("dev-z", d, fog_key=explicit), SimulatedDevice(PROFILES["pi4"])).fog_key == explicit

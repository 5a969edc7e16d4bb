"""Issue 20 finding 3: one identifier grammar (``runtime.ids``), matched whole, everywhere an id goes.

Before: ``re.match(r"^...$")`` let ``"a\\n"`` through (``$`` matches before a final
newline) and each package had its own regex. Table-driven over the grammar and
over every consumer: enrolment (``trust.check_name``), certificates, topics, the
ACL writer, the agent's command line and the coordinator's name checks.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from cloud_coordinator.release import valid_release_name
from cloud_coordinator.sites import valid_site_name
from cloud_coordinator.summaries import valid_fog_id
from cloud_coordinator.supernodes import valid_device_id
from fog_broker.trust import TrustError, check_name
from runtime.broker import acl_for, check_acl
from runtime.errors import LocalViolation, RemoteViolation
from runtime.ids import MAX_ID_LEN, InvalidId, check_id, id_problem, is_id
from runtime.pki import SiteCA
from runtime.topics import Topics, parse

GOOD = ["a", "A", "0", "dev-1", "cam_0", "pi4.kitchen", "x" * MAX_ID_LEN, "a.b-c_d", "fog-default"]
BAD = ["", "a\n", "a\r\n", "\na", "a\r", "a\x00", "a b", "a\t", "a/b", "a+", "#", "+", "x" * (MAX_ID_LEN + 1),
       ".hidden", "-opt", "_x", "a..b", "..", "é", "dev\u2028", "a\x0b", "a\x0c", "a\x1c", "a\x85"]


@pytest.mark.parametrize("value", GOOD)
def test_grammar_accepts(value: str) -> None:
    assert is_id(value) and check_id(value) == value and id_problem(value) == ""


@pytest.mark.parametrize("value", BAD)
def test_grammar_refuses_whole_string(value: str) -> None:
    assert not is_id(value)
    with pytest.raises(InvalidId) as info:
        check_id(value, "device id")
    assert isinstance(info.value, RemoteViolation)
    assert "\n" not in str(info.value) and "\r" not in str(info.value)  # one log line, whatever the input


@pytest.mark.parametrize("value", [None, 1, b"a", ["a"]])
def test_grammar_refuses_non_strings(value: object) -> None:
    assert not is_id(value) and id_problem(value)


@pytest.mark.parametrize("value", BAD)
def test_every_consumer_uses_the_grammar(value: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.raises(TrustError) as info:
        check_name(value, "device id")
    assert info.value.status == 400
    for valid in (valid_release_name, valid_site_name, valid_fog_id, valid_device_id):
        assert not valid(value), valid.__name__
    with pytest.raises(RemoteViolation):
        Topics(value)
    if value not in ("+", "#"):  # a whole-level wildcard builds a subscription filter
        with pytest.raises(RemoteViolation):
            Topics("site").device(value, "BIRTH")
        with pytest.raises(RemoteViolation):
            Topics("site").reply(value)
    if "/" not in value and value:
        with pytest.raises(RemoteViolation):
            parse(f"fogline/v1/site/dev/{value}/BIRTH")
    text = acl_for("site", "fog-site", {"fog-site": "fog", value: "device", "dev-ok": "device"})
    check_acl(text)
    assert "user dev-ok" in text and f"user {value}\n" not in text
    with pytest.raises(LocalViolation):
        acl_for(value, "fog-site", {})


def test_certificates_only_for_ids(tmp_path: Path) -> None:
    ca = SiteCA.load_or_create(tmp_path / "pki", "site")
    with pytest.raises(LocalViolation, match="invalid certificate name"):
        ca.issue_bundle(tmp_path / "x", "a\n", "device")
    assert ca.issue_bundle(tmp_path / "ok", "dev-ok", "device").cert_file


@pytest.mark.parametrize("line", ["user a\x00", "user a b", "topic write a/b c", "topic all a/#", "topic read a/#/b",
                                  "pattern write %u/#", "topic read a//b", "user", "topic read a/b\r"])
def test_check_acl_refuses_lines_the_writer_never_writes(line: str) -> None:
    with pytest.raises(LocalViolation, match="ACL line"):
        check_acl(f"user fog\ntopic readwrite fogline/v1/s/#\n{line}\n")

"""runtime.security.Verifier(state_path=...): replay high-water marks survive a restart.

Finding: "a command replayed 29 s after an agent restart is accepted" (the window lived
in memory only). A "restart" here is a new Verifier on the same state file.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from runtime import security
from runtime.errors import LocalViolation, SecurityError
from runtime.messages import CommandAck, Undeploy
from runtime.security import Identity, Signer, TrustStore, Verifier

NOW = 1_700_000_000.0
FOG = Identity.from_seed("fog-1", b"fog-1")
OTHER = Identity.from_seed("fog-2", b"fog-2")
CMD = Undeploy("cmd-1", "resnet", 1, 0, 0)


def verifier(path: Path, **kw: Any) -> Verifier:
    return Verifier(TrustStore({FOG.name: FOG.public_key_bytes, OTHER.name: OTHER.public_key_bytes}),
                    state_path=path, **kw)


def rejected(v: Verifier, frame: bytes, now: float = NOW) -> str:
    with pytest.raises(SecurityError) as err:
        v.open(frame, now)
    return err.value.reason


def test_a_command_replayed_after_a_restart_is_refused_and_a_newer_one_accepted(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    fog = Signer(FOG, epoch=5)
    captured = fog.seal_bytes(CMD, NOW)
    verifier(path).open(captured, NOW)

    again = verifier(path)  # the agent restarted; the attacker replays 29 s later, inside the window
    assert rejected(again, captured, NOW + 29) == security.REPLAYED
    assert again.rejected == {security.REPLAYED: 1}
    _, msg = again.open(fog.seal_bytes(CommandAck("c2", "d", True), NOW + 29), NOW + 29)
    assert msg == CommandAck("c2", "d", True)


def test_marks_are_per_sender_and_an_older_epoch_is_stale_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    old_run, run, other = Signer(FOG, epoch=4), Signer(FOG, epoch=5), Signer(OTHER, epoch=1)
    old_frame = old_run.seal_bytes(CMD, NOW)
    v = verifier(path)
    for frame in (old_frame, run.seal_bytes(CMD, NOW), run.seal_bytes(CMD, NOW), other.seal_bytes(CMD, NOW)):
        v.open(frame, NOW)
    assert json.loads(path.read_text()) == {"version": 1, "marks": {"fog-1": [5, 2], "fog-2": [1, 1]}}

    again = verifier(path)
    assert rejected(again, old_run.seal_bytes(CMD, NOW)) == security.STALE_EPOCH
    assert rejected(again, Signer(OTHER, epoch=1).seal_bytes(CMD, NOW)) == security.REPLAYED  # seq 1 again
    again.open(other.seal_bytes(CMD, NOW), NOW)  # fog-2's seq 2
    again.open(Signer(FOG, epoch=6).seal_bytes(CMD, NOW), NOW)  # a newer fog run starts a new window
    assert json.loads(path.read_text())["marks"] == {"fog-1": [6, 1], "fog-2": [1, 2]}


def test_seqs_below_the_mark_are_refused_after_restart_even_if_never_seen(tmp_path: Path) -> None:
    """Only the high-water mark is stored, not the window's bitmap: conservative by design."""
    path = tmp_path / "replay.json"
    s = Signer(FOG, epoch=1)
    frames = [s.seal_bytes(CMD, NOW) for _ in range(3)]
    v = verifier(path)
    v.open(frames[2], NOW)
    v.open(frames[0], NOW)  # reordered, inside the window: fine before the restart
    assert rejected(verifier(path), frames[1]) == security.REPLAYED


def test_state_file_is_private_written_atomically_and_only_when_the_mark_advances(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "replay.json"
    replaced: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(security.os, "replace", lambda a, b: (replaced.append(str(b)), real_replace(a, b)))
    s = Signer(FOG, epoch=1)
    frames = [s.seal_bytes(CMD, NOW) for _ in range(4)]
    v = verifier(path)
    assert not path.exists()  # a missing file is an empty state
    for i in (1, 0, 3, 2):  # marks 2, -, 4, -
        v.open(frames[i], NOW)
    assert replaced == [str(path)] * 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.json"]  # no tmp file left
    v.forget("fog-1")
    assert json.loads(path.read_text())["marks"] == {}


def test_a_failed_write_is_logged_counted_cleaned_up_and_the_envelope_still_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "replay.json"

    def fail(a: Any, b: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(security.os, "replace", fail)
    v = verifier(path)
    with caplog.at_level(logging.ERROR, logger="runtime.security"):
        v.open(Signer(FOG, epoch=1).seal_bytes(CMD, NOW), NOW)
    assert v.accepted == 1 and v.persist_errors == 1
    assert list(tmp_path.iterdir()) == []  # the tmp file was removed
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    # a state directory that is gone: same outcome
    monkeypatch.undo()
    gone = verifier(tmp_path / "missing-dir" / "replay.json")
    gone.open(Signer(FOG, epoch=1).seal_bytes(CMD, NOW), NOW)
    assert gone.accepted == 1 and gone.persist_errors == 1


@pytest.mark.parametrize("content", [
    b"", b"{", b"\xff\xfe", b"[]", b'{"version": 2, "marks": {}}', b'{"version": 1}',
    b'{"version": 1, "marks": []}', b'{"version": 1, "marks": {"fog-1": [5]}}',
    b'{"version": 1, "marks": {"fog-1": [5, -1]}}', b'{"version": 1, "marks": {"fog-1": [true, 1]}}',
    b'{"version": 1, "marks": {"fog-1": [5, 1.5]}}', b'{"version": 1, "marks": {"fog-1": "5,1"}}',
])
def test_a_corrupt_state_file_refuses_to_start_with_one_line(tmp_path: Path, content: bytes) -> None:
    """Refuse rather than start empty: an empty state accepts any replay inside the timestamp window.

    The file is only ever replaced whole (tmp, fsync, rename), so a crash cannot corrupt
    it; corruption means tampering or a failing disk, which an operator must look at.
    """
    path = tmp_path / "replay.json"
    path.write_bytes(content)
    with pytest.raises(LocalViolation, match=r"replay state .*replay\.json") as err:
        verifier(path)
    assert "\n" not in str(err.value)


def test_without_state_path_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    v = Verifier(TrustStore({FOG.name: FOG.public_key_bytes}))
    v.open(Signer(FOG, epoch=1).seal_bytes(CMD, NOW), NOW)
    assert v.state_path is None and list(tmp_path.iterdir()) == []

"""Issue 28: a round counts only with its quorum, deadlines follow reply times, TTLs never cut a reply in
time, and an unchanged model is not a new release. Strategy-level on an in-process Grid with a virtual clock."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from onnx import TensorProto, helper, numpy_helper

import cloud_coordinator.strategy as strategy_mod
from cloud_coordinator.aggregation import get_rule, quorum
from cloud_coordinator.metrics import families
from cloud_coordinator.release import Release
from cloud_coordinator.rounds import DeadlinePolicy, message_ttl, round_deadline
from cloud_coordinator.sites_cli import round_line
from cloud_coordinator.strategy import CheckpointConfig, RobustStrategy, RoundConfig, RunFailed
from runtime.errors import LocalViolation

from _grid import LocalGrid, pull_client

# ------------------------------------------------------------------ pure: the quorum and the deadline


@pytest.mark.parametrize(("rule", "f", "min_replies", "want"), [
    ("krum", 1, None, 5),               # 2f+3
    ("multi_krum", 2, None, 7),
    ("trimmed_mean", 1, None, 3),       # 2f+1
    ("median", 2, None, 5),
    ("centered_clipping", 1, None, 3),
    ("bulyan", 1, None, 7),             # 4f+3
    ("mean", 0, None, 1),               # never fewer than 1
    ("trimmed_mean", 1, 4, 4),          # the run asks for more
    ("krum", 1, 2, 5),                  # ... never fewer than the rule needs
])
def test_quorum_defaults_to_what_the_rule_needs_for_f(rule: str, f: int, min_replies: int | None, want: int) -> None:
    assert quorum(get_rule(rule, f).min_clients, min_replies) == want
    s = RobustStrategy(rule, f=f, rounds=RoundConfig(min_train_nodes=1, min_replies=min_replies))
    assert s.quorum == want


def test_min_replies_below_one_is_refused() -> None:
    with pytest.raises(LocalViolation, match="min_replies"):
        RobustStrategy("median", f=1, rounds=RoundConfig(min_replies=0))


P = DeadlinePolicy(initial_s=30.0, min_s=30.0, max_s=300.0, margin=3.0)


@pytest.mark.parametrize(("policy", "reply_s", "starved", "want"), [
    (P, [], 0, 30.0),                          # nothing measured yet: the user's round timeout
    (P, [], 1, 60.0),                          # a starved attempt doubles it
    (P, [], 5, 300.0),                         # ... up to the bound
    (P, [2.0] * 20, 0, 30.0),                  # a quiet machine: never below the floor
    (P, [40.0] * 19 + [1000.0], 0, 120.0),     # p95 of 20 is the 19th: one outlier does not set it
    (P, [40.0] * 18 + [90.0] * 2, 0, 270.0),   # two slow replies in 20 do
    (P, [200.0], 0, 300.0),                    # clamped above
    (P, [float("nan"), -1.0, 10.0], 0, 30.0),  # unusable samples are ignored
    (DeadlinePolicy(initial_s=10.0, min_s=5.0, max_s=100.0, margin=2.0, window=2), [50.0, 3.0, 3.0], 0, 6.0),
])
def test_round_deadline(policy: DeadlinePolicy, reply_s: list[float], starved: int, want: float) -> None:
    assert round_deadline(policy, reply_s, starved) == pytest.approx(want)


@pytest.mark.parametrize("deadline", [0.5, 30.0, 60.0, 299.0, 3600.0])
@pytest.mark.parametrize("grace", [0.0, 5.0, 120.0])
def test_message_ttl_never_shorter_than_the_deadline(deadline: float, grace: float) -> None:
    assert message_ttl(deadline, grace) >= deadline + grace


def test_deadline_policy_refuses_inverted_bounds() -> None:
    with pytest.raises(LocalViolation, match="round deadlines"):
        DeadlinePolicy(initial_s=60.0, min_s=60.0, max_s=30.0)
    with pytest.raises(LocalViolation, match="round deadlines"):
        RobustStrategy("median", f=1, rounds=RoundConfig(round_timeout=60.0, max_round_timeout=30.0))


# ------------------------------------------------------------------ a Grid on a virtual clock, with Flower's TTL


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class SlowGrid(LocalGrid):
    """Every pull is ``step`` virtual seconds; a reply reaches the SuperLink ``delay(round, attempt)`` seconds after
    its Message was pushed, and is expired (MESSAGE_UNAVAILABLE, as the SuperLink does) past the Message's TTL."""

    def __init__(self, clock: Clock, delay: Any, step: float = 15.0) -> None:
        super().__init__()
        self.clock, self.delay, self.step = clock, delay, step
        self.expired = 0
        self.attempts: dict[int, int] = {}
        self._slow: dict[str, tuple[float, float, Message, Message]] = {}  # id -> (ready at, expires at, ins, rep)

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        rnd = int(messages[0].metadata.group_id) if messages else 0
        self.attempts[rnd] = self.attempts.get(rnd, 0) + 1
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            if mid in self._pending:
                _, reply = self._pending.pop(mid)
                wait = self.delay(rnd, self.attempts[rnd])
                if wait is not None:
                    self._slow[mid] = (self.clock.t + wait, self.clock.t + msg.metadata.ttl, msg, reply)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        self.clock.t += self.step
        got = []
        for mid in list(message_ids):
            if mid in self._slow and self._slow[mid][0] <= self.clock.t:
                ready, expires, ins, reply = self._slow.pop(mid)
                if ready > expires:
                    self.expired += 1
                    reply = Message(Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                                          reason="It may have expired due to its TTL"), reply_to=ins)
                got.append(reply)
        return got


def _init() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)), "b": Array(np.zeros(3, np.float32))})


def _hook(arrays: ArrayRecord) -> onnx.ModelProto:
    """y = x + b: the release's bytes change exactly when the bias does."""
    b = numpy_helper.from_array(arrays["b"].numpy().astype(np.float32), "b")
    graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], [b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _slow_grid(delay: Any, n: int = 5) -> tuple[SlowGrid, Clock]:
    clock = Clock()
    g = SlowGrid(clock, delay)
    for i in range(n):
        g.add(pull_client(np.float32(i), noise_seed=i))
    return g, clock


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strategy_mod, "POLL_S", 0.0)  # virtual time: pulls advance it (no real sleep)


def _strategy(clock: Clock, tmp_path: Path, **kw: Any) -> RobustStrategy:
    return RobustStrategy("trimmed_mean", f=1, clock=clock, release=Release("m", _hook, input_shape=(1, 3)),
                          **kw,
                          rounds=RoundConfig(fraction_evaluate=0.0, round_timeout=30.0, grace=0.0,
                                             max_round_timeout=600.0),
                          checkpoints=CheckpointConfig(dirs=[tmp_path]))


def test_late_replies_within_the_adapted_deadline_are_never_expired_by_the_ttl(tmp_path: Path) -> None:
    # Every reply is later than the user's 30 s round timeout: round 1 at 40 s, round 2 at 90 s, round 3 at
    # 150 s. With a TTL of round-timeout + grace + 30 s (before issue 28) the last two rounds' replies expired.
    g, clock = _slow_grid(lambda rnd, attempt: {1: 40.0, 2: 90.0, 3: 150.0}[rnd])
    _strategy(clock, tmp_path).start(grid=g, initial_arrays=_init(), num_rounds=3)
    report = json.loads((tmp_path / "report.json").read_text())
    hist = report["history"]
    assert g.expired == 0
    assert [len(h["accepted"]) for h in hist] == [5, 5, 5] and [h["replies"] for h in hist] == [5, 5, 5]
    assert hist[0]["retried"] == ["0/5 replies within 30 s (quorum 3)"]  # the first deadline knew nothing yet
    assert [h["reply_s"] for h in hist] == [[45.0] * 5, [90.0] * 5, [150.0] * 5]  # what the deadlines came from
    # 2 x 30, then p95 x 3 of the reply times seen (pulls every 15 s: the 40 s replies were seen at 45 s)
    assert [h["deadline_s"] for h in hist] == [60.0, 135.0, 270.0]
    assert all("retried" not in h for h in hist[1:])
    assert all(m.metadata.ttl >= 270.0 for m in g.pushed if m.metadata.group_id == "3")
    assert [r["version"] for r in report["releases"]] == [1, 2, 3]


def test_a_starved_round_is_retried_with_its_reason_then_stops_loudly_without_a_release(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g, clock = _slow_grid(lambda rnd, attempt: None)  # the SuperNodes are paused: nobody answers
    with pytest.raises(RunFailed) as info:
        _strategy(clock, tmp_path).start(grid=g, initial_arrays=_init(), num_rounds=3)
    line = str(info.value)
    assert "\n" not in line and "round 1 failed 3 attempts" in line and "0/5 replies within 120 s (quorum 3)" in line
    assert json.loads((tmp_path / "fatal.json").read_text())["error"] == line
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["round"] == 1 and progress["retries"] == 2 and progress["quorum"] == 3
    assert progress["retried"] == "0/5 replies within 60 s (quorum 3)" and progress["deadline_s"] == 120.0
    assert g.attempts == {1: 3}
    assert not list((tmp_path / "releases").glob("*.release")) and not (tmp_path / "report.json").exists()
    assert not list(tmp_path.glob("ckpt-*"))
    # what fogline status --coordinator and the metrics show
    assert round_line({**progress, "last": None}).startswith(
        "rounds: round 1 attempt 3, quorum 3, deadline 120 s, retries 2 (last: 0/5 replies within 60 s (quorum 3))")
    fams = {m.name: m for m in families({"now": 0.0, "progress": progress})}
    value = {name: fams[name].samples[0].value for name in
             ("fogline_coordinator_round_quorum", "fogline_coordinator_round_deadline_seconds")}
    assert value == {"fogline_coordinator_round_quorum": 3, "fogline_coordinator_round_deadline_seconds": 120.0}
    assert fams["fogline_coordinator_round_retries"].samples[0].value == 2
    import argparse

    from cloud_coordinator.sites_cli import status_cmd

    capsys.readouterr()
    assert status_cmd(argparse.Namespace(checkpoint_dir=tmp_path, names=[], json=False)) == 0  # no sites: rounds
    assert "rounds: round 1 attempt 3, quorum 3, deadline 120 s, retries 2" in capsys.readouterr().out


def test_an_unchanged_model_is_not_a_new_release(tmp_path: Path) -> None:
    def echo_after_round_1(i: int) -> Any:
        train = pull_client(np.float32(i), noise_seed=i)

        def fn(msg: Message) -> RecordDict:
            if int(msg.content["config"]["server-round"]) == 1:
                return train(msg)
            return RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 10})})
        return fn

    def grid() -> tuple[SlowGrid, Clock]:
        g, clock = _slow_grid(lambda rnd, attempt: 1.0, n=0)
        for i in range(5):
            g.add(echo_after_round_1(i))
        return g, clock

    g, clock = grid()
    _strategy(clock, tmp_path).start(grid=g, initial_arrays=_init(), num_rounds=3)
    rels = json.loads((tmp_path / "report.json").read_text())["releases"]
    assert [(r["round"], r["version"], bool(r.get("unchanged"))) for r in rels] == [
        (1, 1, False), (2, 1, True), (3, 1, True)]
    assert len(list((tmp_path / "releases").glob("m-v*.release"))) == 1
    g, clock = grid()  # a new process (a restart) knows the outbox's newest release
    _strategy(clock, tmp_path).start(grid=g, initial_arrays=_init(), num_rounds=4)
    rels = json.loads((tmp_path / "report.json").read_text())["releases"]
    assert rels == [{"round": 4, "unchanged": True, "version": 1, "sha256": rels[0]["sha256"]}]
    assert len(list((tmp_path / "releases").glob("m-v*.release"))) == 1


def test_replies_in_time_but_unusable_are_not_a_reason_to_wait_longer(tmp_path: Path) -> None:
    g, clock = _slow_grid(lambda rnd, attempt: 10.0, n=2)
    g.add(lambda m: Error(code=0, reason="boom"))  # answers at once, but nothing to aggregate
    with pytest.raises(RunFailed, match=r"last: 2/3 replies within 45 s \(quorum 3, 1 unusable\)"):
        _strategy(clock, tmp_path).start(grid=g, initial_arrays=_init(), num_rounds=1)
    progress = json.loads((tmp_path / "progress.json").read_text())
    # 3 x the replies measured (seen at the 15 s pull); no doubling (90 s): nobody was late
    assert progress["deadline_s"] == 45.0 and progress["retries"] == 2


def test_quorum_retries_and_deadline_bound_come_from_the_flag_else_the_run_config() -> None:
    import argparse

    from cloud_coordinator.cli import _check_run_config, _round_options

    def ns(**kw: Any) -> argparse.Namespace:
        base = {"min_replies": None, "max_attempts": None, "max_round_timeout": None, "rule": None, "f": None,
                "selection": None, "battery_floor": 0.3}
        return argparse.Namespace(**{**base, **kw})

    cfg = {"min-replies": 4, "max-attempts": 5, "max-round-timeout": 200}
    assert _round_options(ns(), cfg) == {"min_replies": 4, "max_attempts": 5, "max_round_timeout": 200.0}
    assert _round_options(ns(min_replies=6), cfg)["min_replies"] == 6
    assert _round_options(ns(), {}) == {"min_replies": None, "max_attempts": None, "max_round_timeout": None}
    for bad, why in (({"min-replies": 0}, "min-replies must be an integer >= 1"),
                     ({"max-attempts": 1.5}, "max-attempts must be an integer >= 1"),
                     ({"max-round-timeout": -1}, "max-round-timeout must be > 0")):
        with pytest.raises(ValueError, match=why):
            _check_run_config(bad, ns())


def test_the_watchdog_grows_with_the_serverapps_adapted_deadline(tmp_path: Path) -> None:
    from cloud_coordinator.app import bundled_app
    from cloud_coordinator.launcher import Supervisor, SupervisorOptions
    from cloud_coordinator.supervision import watchdog_bound

    sup = Supervisor(SupervisorOptions(tmp_path, bundled_app("wine"), tmp_path / "settings.json",
                                       watchdog_s=watchdog_bound(60.0, 5.0)))
    (tmp_path / "progress.json").write_text(json.dumps({"round": 3, "deadline_s": 60.0, "grace_s": 5.0}))
    sup._note_progress()
    assert sup._watchdog_s == watchdog_bound(60.0, 5.0)  # 245 s: three 60 s waits, grace, start-up
    (tmp_path / "progress.json").write_text(json.dumps({"round": 4, "deadline_s": 270.0, "grace_s": 5.0}))
    os.utime(tmp_path / "progress.json", ns=(0, 10**18))  # a new stamp, whatever the file system's resolution
    sup._note_progress()
    assert sup._watchdog_s == watchdog_bound(270.0, 5.0)  # a working 270 s attempt is not a stall


def test_the_release_key_of_a_run_without_checkpoints_is_kept_with_the_other_keys(tmp_path: Path) -> None:
    """Issue 28 (low): with no checkpoint directory the release signing key was written into work_dir,
    beside what it vouches for; it lives in ``<work_dir>.keys/`` (0700) as ``key_path`` says, 0600."""
    g, clock = _slow_grid(lambda rnd, attempt: 1.0)
    work = tmp_path / "run"
    RobustStrategy("trimmed_mean", f=1, clock=clock, work_dir=work,
                   release=Release("m", _hook, input_shape=(1, 3)),
                   rounds=RoundConfig(fraction_evaluate=0.0, round_timeout=30.0, grace=0.0)).start(
        grid=g, initial_arrays=_init(), num_rounds=1)
    assert list((work / "releases").glob("m-v*.release"))
    assert not list(work.glob("*.key"))
    key = tmp_path / "run.keys" / "checkpoint.key"
    assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600
    assert (key.parent.stat().st_mode & 0o777) == 0o700


def test_fogline_status_coordinator_reaches_the_coordinators_handler_without_patching_the_fog(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 31: ``fogline status --coordinator`` is the fog's command; it finds the coordinator's handler by
    entry point (``fogline.status``), and no module patches the fog's."""
    import fog_broker.service_cli as fog_cli
    from runtime.cli import main

    assert not hasattr(fog_cli, "coordinator_status")
    (tmp_path / "progress.json").write_text(json.dumps({"round": 2, "attempt": 1, "quorum": 3, "deadline_s": 30.0,
                                                         "retries": 0, "waiting": "replies", "at": 0.0}))
    capsys.readouterr()
    assert main(["status", "--coordinator", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint_dir"] == str(tmp_path) and doc["rounds"]["round"] == 2, doc

"""The ServerApp's side of supervision, in process: errors are blamed on the right node, and the app's own
exceptions stop the run once, with ``fatal.json`` (no restart can fix a bug in the app)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

from cloud_coordinator.settings import FATAL_FILE
from cloud_coordinator.strategy import RobustStrategy, RoundConfig, RunFailed

from _grid import Crash, LocalGrid, pull_client


def _init() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)), "b": Array(np.zeros(3, np.float32))})


class SuperLinkErrors(LocalGrid):
    """Nodes in ``unavailable`` never answer: the SuperLink answers for them, as Flower's does, with an error
    Message whose source is the SuperLink itself (node id 1), not the node."""

    def __init__(self, unavailable: set[int]) -> None:
        super().__init__()
        self.unavailable = unavailable

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        ids = list(super().push_messages(msgs))
        for mid, msg in zip(ids, msgs):
            if msg.metadata.dst_node_id in self.unavailable:
                self._pending[mid] = (0, create_message_error_unavailable_res_message(msg.metadata, "node_unavail"))
        return ids


def test_a_superlink_error_reply_is_blamed_on_the_node_it_was_sent_to_with_flowers_code() -> None:
    g = SuperLinkErrors(set())
    good = [g.add(pull_client(np.float32(i), noise_seed=i)) for i in range(3)]
    silent = g.add(lambda m: None)
    g.unavailable.add(silent)
    s = RobustStrategy("median", f=1,
                       rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=5.0, grace=0.0))
    new, metrics, entry = s.train_round(g, 1, _init(), ConfigRecord())
    assert new is not None and metrics is not None
    assert f"node-{SUPERLINK_NODE_ID}" not in entry["rejected"]
    why = entry["rejected"][f"node-{silent}"]
    assert why.startswith("client error (flower 5 NODE_UNAVAILABLE, from the SuperLink: Error: Node Unavailable")
    assert sorted(entry["accepted"]) == sorted(f"node-{n}" for n in good)
    assert metrics["rejected-client-error"] == 1  # the metric name stays one per kind of rejection


def test_a_clients_own_error_keeps_its_code_and_reason() -> None:
    g = LocalGrid()
    for i in range(3):
        g.add(pull_client(np.float32(i), noise_seed=i))
    bad = g.add(lambda m: Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="KeyError: 'x'"))
    s = RobustStrategy("median", f=1,
                       rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=5.0, grace=0.0))
    _, _, entry = s.train_round(g, 1, _init(), ConfigRecord())
    assert entry["rejected"][f"node-{bad}"] == "client error (flower 2 CLIENT_APP_RAISED_EXCEPTION: KeyError: 'x')"


class RaisingStrategy(RobustStrategy):
    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        raise ZeroDivisionError("the user's strategy divides by zero")


def _grid(n: int = 3) -> LocalGrid:
    g = LocalGrid()
    for i in range(n):
        g.add(pull_client(np.float32(i), noise_seed=i))
    return g


def _fatal(work: Path) -> dict[str, Any]:
    doc = json.loads((work / FATAL_FILE).read_text())
    assert isinstance(doc, dict)
    return doc


def test_a_raising_strategy_writes_fatal_json_with_its_traceback(tmp_path: Path) -> None:
    s = RaisingStrategy("median", f=1, work_dir=tmp_path,
                        rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=5.0, grace=0.0))
    with pytest.raises(RunFailed, match="the ServerApp raised ZeroDivisionError: the user's strategy divides by zero"):
        s.start(grid=_grid(), initial_arrays=_init(), num_rounds=2)
    doc = _fatal(tmp_path)
    assert "\n" not in doc["error"] and "aggregate_train" in doc["error"]
    assert "Traceback" in doc["traceback"] and "ZeroDivisionError" in doc["traceback"]


def test_a_raising_evaluate_fn_writes_fatal_json(tmp_path: Path) -> None:
    def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": {"a": 1.0}["missing"]})

    s = RobustStrategy("median", f=1, work_dir=tmp_path,
                       rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=5.0, grace=0.0))
    with pytest.raises(RunFailed, match="KeyError: 'missing'"):
        s.start(grid=_grid(), initial_arrays=_init(), num_rounds=2, evaluate_fn=evaluate_fn)
    assert "evaluate_fn" in _fatal(tmp_path)["traceback"]


def test_a_grid_failure_is_not_the_apps_fault(tmp_path: Path) -> None:
    """An exception from inside a Grid call is the SuperLink's connection: the supervisor restarts, no fatal.json."""
    g = _grid()
    g.crash_on = (1, 1)
    s = RobustStrategy("median", f=1, work_dir=tmp_path,
                       rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=5.0, grace=0.0))
    with pytest.raises(Crash):
        s.start(grid=g, initial_arrays=_init(), num_rounds=2)
    assert not (tmp_path / FATAL_FILE).exists()


@pytest.mark.integration
def test_every_attempt_leaves_a_heartbeat_naming_what_it_waits_for(tmp_path: Path) -> None:
    """progress.json is what the supervisor's watchdog reads: the round, and the nodes it waits for."""
    from cloud_coordinator.settings import PROGRESS_FILE

    g = _grid(2)
    s = RobustStrategy("median", f=1, work_dir=tmp_path,
                       rounds=RoundConfig(min_train_nodes=3, fraction_evaluate=0.0, round_timeout=0.5, grace=0.0,
                                          max_attempts=1))
    s.train_round(g, 1, _init(), ConfigRecord())  # two nodes for a quorum of three: the attempt fails
    doc = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert doc["round"] == 1 and doc["attempt"] == 1 and doc["connected"] == sorted(f"node-{n}" for n in g.nodes)
    assert doc["waiting"] == "round 1 attempt 1: median with f=1 needs 3 clients, 2 eligible of 2 connected"
    g.add(pull_client(np.float32(3)))
    s.train_round(g, 2, _init(), ConfigRecord())
    doc = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert doc["waiting"] == "round 2 attempt 1: waiting for replies of 3 nodes (quorum 3, deadline 0.5 s)"
    assert doc["eligible"] == sorted(f"node-{n}" for n in g.nodes)

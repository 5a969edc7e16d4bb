"""Finding 14: one Byzantine Flower client stopped the round loop, and SuperNodes were anonymous.

Attacks, on real SuperLink/SuperNodes: a client replying ``num-examples = inf`` (was an
uncaught OverflowError), a client replying NaN updates (with trimmed_mean f=1 n=3 an
uncaught AggregationError), and a SuperNode with an unregistered key that claims to be
device ``dev-0`` in its node config. Now SuperNode authentication is on by default (the
coordinator registers its authorized keys with the SuperLink, which refuses any other key),
device ids come from the authenticated key, and every per-reply problem is a counted
rejection: the rounds complete. In-process checks cover duplicates and the n=3 case.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from cloud_coordinator.supernodes import devices_of, key_id

from _coordinator import Deployment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cloud_coordinator"))
from cloud_coordinator.strategy import RobustStrategy, RoundConfig

from _grid import LocalGrid, pull_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.nightly  # test_flower_control_api's coordinator test holds these items in make test
def test_byzantine_replies_and_an_impostor_do_not_stop_the_rounds(tmp_path: Path) -> None:
    dep = Deployment(tmp_path)
    try:
        n = 5
        roles = {3: " byzantine='inf-examples'", 4: " byzantine='nan'"}
        keys = [dep.authorize(f"dev-{i}") for i in range(n)]
        coord = dep.coordinator("--rounds", "2", "--rule", "median", "--f", "1", "--min-clients", "3",
                                "--num-partitions", str(n), "--round-timeout", "40", "--grace", "2", "--timeout", "200")
        dep.wait_file(dep.ck / "superlink.json", 60)  # the keys are registered: SuperNodes may connect
        for i in range(n):
            dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={n}{roles.get(i, '')}")
        impostor_key = tmp_path / "impostor"
        assert dep.fogline("supernodes", "keygen", "--out", str(impostor_key)).returncode == 0
        dep.node("impostor", impostor_key / "supernode.key", f"device-id='dev-0' partition-id=0 num-partitions={n}")
        assert dep.wait_exit(coord, 200) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        assert rep["rounds_done"] == 2
        for h in rep["history"]:
            assert h["clients"] == [f"dev-{i}" for i in range(n)]  # the impostor never got a round
            assert h["rejected"].get("dev-3") == "absurd example count"
            assert h["rejected"].get("dev-4") == "non-finite values"
            assert h["accepted"] == ["dev-0", "dev-1", "dev-2"] and not h.get("skipped")
        assert rep["history"][-1]["server"]["accuracy"] > 0.8
    finally:
        dep.close()


def _init() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(3, np.float32))})


def test_nan_with_trimmed_mean_and_inf_counts_keep_the_loop_going() -> None:
    # n=3 with these two is below trimmed_mean's quorum: retried, then a loud stop (tests/cloud_coordinator)
    g = LocalGrid()
    g.add(pull_client(np.float32(1.0), noise_seed=0))
    g.add(pull_client(np.float32(1.0), noise_seed=4))
    g.add(pull_client(np.float32(1.0), noise_seed=1))
    g.add(pull_client(np.float32(1.0), noise_seed=2, examples=float("inf")))
    g.add(pull_client(np.float32(1.0), noise_seed=3, attack="nan"))
    s = RobustStrategy("trimmed_mean", f=1,
                       rounds=RoundConfig(fraction_evaluate=0, round_timeout=5, grace=0, max_attempts=1))
    res = s.start(grid=g, initial_arrays=_init(), num_rounds=3)  # returns: no OverflowError, no AggregationError
    assert sorted(res.train_metrics_clientapp) == [1, 2, 3]
    assert all(m["rejected-absurd-example-count"] == 1 for m in res.train_metrics_clientapp.values())


def test_device_ids_come_from_authenticated_keys_and_duplicates_are_refused(tmp_path: Path) -> None:
    from cloud_coordinator.supernodes import keygen

    pubs = [keygen(tmp_path / f"k{i}")[1].read_bytes() for i in range(3)]
    book = {key_id(pubs[0]): "dev-0", key_id(pubs[1]): "dev-1"}
    devices, refused = devices_of([(11, pubs[0]), (12, pubs[1]), (13, pubs[2]), (14, b"")], book)
    assert devices == {11: "dev-0", 12: "dev-1"} and refused == {13: "unknown node", 14: "unknown node"}
    devices, refused = devices_of([(11, pubs[0]), (15, pubs[0])], book)  # one key on two nodes
    assert devices == {} and refused == {11: "duplicate device", 15: "duplicate device"}

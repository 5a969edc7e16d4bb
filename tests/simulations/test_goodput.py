import math
import random

import pytest

from cloud_coordinator.policy import CheckpointPolicy, rounds_between_checkpoints
from simulations.churn import FailureModel, SimBattery, drain, fault_schedule, time_to_empty
from simulations.goodput import RunModel, simulate_run


def test_no_failures_goodput_is_the_checkpoint_overhead():
    m = RunModel(rounds=10, round_s=8.0, checkpoint_s=2.0, restart_s=5.0, mtbf_s=1e12)
    assert simulate_run(m, 1, random.Random(0)).goodput(m) == pytest.approx(8 / 10)
    assert simulate_run(m, None, random.Random(0)).goodput(m) == pytest.approx(1.0)
    # every 5 rounds: 2 checkpoints
    out = simulate_run(m, 5, random.Random(0))
    assert out.checkpoints == 2 and out.wall_s == pytest.approx(84.0)


def test_crash_loses_only_rounds_since_last_checkpoint():
    m = RunModel(rounds=50, round_s=1.0, checkpoint_s=0.1, restart_s=1.0, mtbf_s=20.0)
    out = simulate_run(m, 1, random.Random(3))
    assert out.crashes > 0
    assert out.rounds_redone == 0  # checkpointed every round: a crash loses only the in-flight round
    assert simulate_run(m, 10, random.Random(3)).rounds_redone > 0


def test_daly_interval_beats_both_baselines_on_a_churning_run():
    m = RunModel(rounds=200, round_s=8.0, checkpoint_s=2.0, restart_s=5.0, mtbf_s=600.0)
    every = rounds_between_checkpoints(CheckpointPolicy(mode="daly", max_rounds_between=1000),
                                       m.round_s, m.checkpoint_s, failures=50, observed_s=50 * 600.0)
    assert 2 <= every <= 20

    def mean_goodput(k):
        rng = random.Random(5)
        return sum(simulate_run(m, k, rng).goodput(m) for _ in range(100)) / 100

    daly, each, never = mean_goodput(every), mean_goodput(1), mean_goodput(None)
    assert daly > each and daly > never


def test_battery_drains_and_charges_within_bounds():
    b = SimBattery(capacity_wh=10.0, level=0.5)
    assert drain(b, 10.0, 1800).level == pytest.approx(0.0)
    assert drain(b, 10.0, 360).level == pytest.approx(0.4)
    assert drain(SimBattery(10.0, 0.99, charge_w=20.0), 0.0, 3600).level == 1.0
    assert time_to_empty(b, 10.0) == pytest.approx(1800.0)
    assert math.isinf(time_to_empty(SimBattery(10.0, 0.5, charge_w=5.0), 2.0))


def test_fault_schedule_is_sorted_and_deterministic():
    ids = [f"d{i}" for i in range(20)]
    a = fault_schedule(ids, FailureModel(mtbf_s=100.0, mttr_s=10.0), 1000.0, random.Random(1))
    b = fault_schedule(ids, FailureModel(mtbf_s=100.0, mttr_s=10.0), 1000.0, random.Random(1))
    assert a == b and a == sorted(a, key=lambda f: (f.at_s, f.target))
    assert 100 < sum(f.kind == "crash" for f in a) < 300  # ~ 20 * 1000 / 110

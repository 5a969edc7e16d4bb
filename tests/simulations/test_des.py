import itertools
import random

import pytest

from fog_broker.placement import Workload
from simulations.churn import FailureModel
from simulations.des import FleetSim, SimConfig, make_fleet
from simulations.scenario import ScenarioError, load_scenario

PROFILE = {"model": "m", "input_bytes": 3072, "segments": [
    {"name": f"s{i}", "flops": 2e7, "param_bytes": 40000, "activation_bytes": 65536, "out_bytes": 16384}
    for i in range(4)]}


def _workloads(n=3, replicas=2):
    return [Workload.from_dict({"name": f"w{i}", "tenant": "t", "priority": 1, "replicas": replicas,
                                "objective": "latency", "source": f"dev-{i:05d}", "sink": f"dev-{i + 1:05d}",
                                "selectors": {}, "tolerations": [], "profile": PROFILE}) for i in range(n)]


def _fake_clock():
    tick = itertools.count()
    return lambda: next(tick) * 1e-3


def _run(seed, mtbf=1800.0, hang=0.0, duration=3600.0):
    devs = make_fleet(30, random.Random(seed))
    cfg = SimConfig(duration_s=duration, failure=FailureModel(mtbf_s=mtbf, mttr_s=120.0), hang_fraction=hang,
                    seed=seed)
    return FleetSim(devs, _workloads(), cfg, clock=_fake_clock()).run()


def test_deterministic_for_a_seed():
    a, b = _run(3).summary(), _run(3).summary()
    for s in (a, b):
        s.pop("wall_s"), s.pop("sim_hours_per_wall_s"), s.pop("schedule_p50_ms"), s.pop("schedule_p99_ms")
    assert a == b


def test_crashes_of_hosting_devices_are_repaired_and_workloads_stay_available():
    r = _run(5, mtbf=900.0)
    assert r.crashes > 20
    assert r.counters["repairs"] > 0
    assert all(s == "running" for s in r.workload_status.values())
    # two replicas on different power domains: a single crash never takes a workload down for long
    assert min(r.availability.values()) > 0.99


def test_hung_devices_are_found_by_the_deadline_not_the_will():
    r = _run(7, mtbf=600.0, hang=1.0, duration=1800.0)
    assert r.crashes > 0 and r.counters["repairs"] > 0
    assert all(s == "running" for s in r.workload_status.values())


def test_builtin_scenarios_load_and_bad_ones_are_named(tmp_path):
    s = load_scenario("site-200")
    assert s.devices == 200 and len(s.workloads) == 10 and s.failure is not None
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet]\ndevices = 'many'\n")
    with pytest.raises(ScenarioError, match=r"fleet\.devices"):
        load_scenario(bad)


def test_mass_failure_is_repaired_and_timed():
    devs = make_fleet(40, random.Random(6))
    cfg = SimConfig(duration_s=600.0, seed=6, mass_failure_at_s=200.0, mass_failure_fraction=0.25)
    r = FleetSim(devs, _workloads(4), cfg, clock=_fake_clock()).run()
    m = r.summary()["mass_failure"]
    assert m["at_s"] == 200.0 and m["devices"] == 10 and m["devices_crashed"] == 10
    assert m["partitions_hit"] > 0 and m["workloads_hit"] > 0  # the busiest host is always a victim
    # the Will arrives after 0.05 s, the repair deploys in 0.2 s: everything runs again well within a second
    assert 0.2 <= m["recovered_after_s"] < 1.0
    assert m["schedule_calls"] >= m["partitions_hit"] > 0
    assert all(s == "running" for s in r.workload_status.values())


def test_no_mass_failure_means_no_mass_report_and_unchanged_run():
    a = _run(3).summary()
    assert "mass_failure" not in a


def test_scaled_scenario_keeps_spread_endpoints_inside_the_fleet():
    from simulations.des import scaled
    s = scaled(load_scenario("city-10k"), 1000)
    assert s.devices == 1000 and len(s.workloads) == 100
    ends = {w[e] for w in s.workloads for e in ("source", "sink")}
    assert all(int(x[4:]) < 1000 for x in ends)
    assert s.workloads[3]["source"] == f"dev-{(3 * 7) % 1000:05d}"


def test_mass_failure_always_takes_the_busiest_host():
    for seed in (1, 2, 3):
        devs = make_fleet(60, random.Random(seed))
        cfg = SimConfig(duration_s=400.0, seed=seed, mass_failure_at_s=100.0, mass_failure_fraction=0.1)
        m = FleetSim(devs, _workloads(4), cfg, clock=_fake_clock()).run().summary()["mass_failure"]
        assert m["devices"] == 6 and m["partitions_hit"] > 0, seed
        assert m["recovered_after_s"] is not None and m["recovered_after_s"] < 1.0, seed


def test_advancing_in_slices_equals_one_run():
    """The multi-site engine advances each site only up to the coordinator's next event: same result."""
    def sim():
        devs = make_fleet(30, random.Random(9))
        cfg = SimConfig(duration_s=1200.0, failure=FailureModel(mtbf_s=900.0, mttr_s=120.0), seed=9)
        return FleetSim(devs, _workloads(), cfg, clock=_fake_clock())

    whole = sim().run().summary()
    s = sim()
    s.start()
    for t in (0.0, 0.0, 33.3, 100.0, 100.0, 517.25, 1199.99, 5000.0):
        s.advance(t)
    sliced = s.finish().summary()
    for r in (whole, sliced):
        for k in ("wall_s", "sim_hours_per_wall_s", "schedule_p50_ms", "schedule_p99_ms"):
            r.pop(k)
    assert sliced == whole and whole["crashes"] > 0

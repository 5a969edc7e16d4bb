import itertools
import json

import pytest

from cloud_coordinator.rollout import Step, model_ref
from simulations.multisite import MultiSiteSim, release_sha, run_multisite
from simulations.scenario import ScenarioError, load_scenario
from simulations.sites_config import parse_sites

PROFILE = ('{ model = "m", input_bytes = 3072, segments = ['
           + ", ".join(f'{{ name = "s{i}", flops = 2e7, param_bytes = 40000, activation_bytes = 65536, '
                       f'out_bytes = 16384 }}' for i in range(4)) + "] }")


def _toml(*, sites=5, devices=50, duration=1200, check="pass", release_at=300, events="", extra="", rollout=""):
    return f"""
name = "small-sites"
seed = 4
duration_s = {duration}
state_interval_s = 10
[fleet]
devices = {devices}
power_domains = 4
[failures]
mtbf_s = 7200
mttr_s = 300
[[workloads]]
name = "det"
count = 3
replicas = 2
source = "spread"
sink = "spread"
max_partitions = 3
model = "release:det"
profile = {PROFILE}
[sites]
count = {sites}
canary = "site-000"
summary_interval_s = 30
poll_s = 10
fast_poll_s = 1
{extra}
[sites.release]
name = "det"
version = 2
at_s = {release_at}
canary_check = "{check}"
[sites.rollout]
site_timeout_s = 20
publish_retry_s = 5
{rollout}
{events}
"""


def _event(at, kind, sites, fraction=None):
    frac = f"fraction = {fraction}\n" if fraction is not None else ""
    names = ", ".join(f'"{s}"' for s in sites)
    return f'[[sites.events]]\nat_s = {at}\nkind = "{kind}"\nsites = [{names}]\n{frac}'


def _fake_clock():
    tick = itertools.count()
    return lambda: next(tick) * 1e-3


def _sim(tmp_path, **kw):
    p = tmp_path / "s.toml"
    p.write_text(_toml(**kw))
    sc = load_scenario(p)
    sim = MultiSiteSim(sc, parse_sites(sc.sites), clock=_fake_clock())
    return sim, sim.run()


def _strip(s):
    for k in ("wall_s", "cpu_s", "events_per_wall_s", "events_per_cpu_s", "adverts_per_wall_s",
              "adverts_per_cpu_s", "peak_rss_mb"):
        s.pop(k)
    return s


def test_deterministic_for_a_seed(tmp_path):
    ev = _event(100, "cut", ["site-003"]) + _event(400, "restore", ["site-003"])
    a = _strip(_sim(tmp_path, events=ev)[1].summary())
    b = _strip(_sim(tmp_path, events=ev)[1].summary())
    assert a == b
    assert a["sites"] == 5 and a["devices"] == 250 and a["crashes"] > 0
    assert json.dumps(a)  # the report is plain JSON


def test_sites_differ_from_each_other(tmp_path):
    s = _sim(tmp_path)[1].summary()
    assert len({(p["crashes"], p["events"]) for p in s["per_site"]}) > 1  # each site has its own seed


def test_a_cut_site_keeps_repairing_and_its_summaries_drain_on_restore(tmp_path):
    ev = (_event(100, "cut", ["site-002"]) + _event(200, "crash", ["site-002"], 0.2)
          + _event(600, "restore", ["site-002"]))
    sim, r = _sim(tmp_path, events=ev, release_at=900)
    s = r.summary()
    (cut,) = s["cuts"]
    assert cut["site"] == "site-002" and cut["cut_at_s"] == 100 and cut["restored_at_s"] == 600
    # the crash took the busiest host: the site's own controller repaired it with no coordinator
    assert cut["repairs_while_cut"] > 0
    mass = sim.sites["site-002"].sim.mass
    assert mass["partitions_hit"] > 0 and mass["recovered_after_s"] is not None and mass["recovered_after_s"] < 400
    # 500 s cut, a summary every 30 s: about 16 waited, and every one was delivered on restore
    assert 14 <= cut["queued"] <= 18 and cut["drained"] == cut["queued"]
    link = sim.sites["site-002"].link
    assert link.sent == link.delivered and not link.outbox and link.dropped == 0
    assert s["summaries"]["queued"] == s["summaries"]["drained"] == cut["queued"]
    assert s["coordinator"]["polls_lost"] >= 45  # polled every 10 s while cut: no answer
    assert all(p["running"] == "3/3" for p in s["per_site"])


def test_summaries_wait_while_the_link_stays_cut(tmp_path):
    sim, r = _sim(tmp_path, events=_event(300, "cut", ["site-001"]), release_at=2000)
    link = sim.sites["site-001"].link
    assert link.queued > 0 and link.drained == 0 and len(link.outbox) == link.queued
    assert r.summary()["summaries"]["waiting"] == link.queued


def test_release_reaches_every_site_canary_first_and_switches_them(tmp_path):
    sim, r = _sim(tmp_path)
    ro = r.rollout
    assert ro["step"] == Step.DONE.value and ro["canary"] == "site-000" and not ro["reason"]
    tl = ro["timeline"]
    assert [x["site"] for x in tl] == [f"site-{i:03d}" for i in range(5)]
    assert all(x["state"] == "accepted" for x in tl)
    acc = [x["accepted_s"] for x in tl]
    assert acc == sorted(acc) and acc[0] >= 300
    # the canary ran the new version and passed the held-out batch before any other site got it
    assert tl[0]["switched_s"] < acc[1]
    # timed at the event that completed the switch: the deploys (0.2 s each) after the release arrived
    assert all(x["accepted_s"] < x["switched_s"] < x["accepted_s"] + 5 for x in tl)
    ref2 = model_ref(release_sha("det", 2))
    for s in sim.sites.values():
        assert s.releases["det"] == (2, ref2)
        assert all(spec.model == ref2 for spec in s.specs.values())
        assert all(e.version == 2 and e.status == "running" for e in s.sim.controller.workloads.values())


@pytest.mark.parametrize("check", ["outputs", "latency"])
def test_failing_canary_rolls_back_and_no_other_site_gets_the_release(tmp_path, check):
    sim, r = _sim(tmp_path, check=check)
    ro = r.rollout
    assert ro["step"] == Step.ROLLED_BACK.value, ro
    assert ro["rollback"] == {"restores": 1, "as_version": 3}
    assert "canary site-000" in ro["cause"]
    ref1 = model_ref(release_sha("det", 1))
    canary = sim.sites["site-000"]
    assert 2 in canary.accepted_at and canary.releases["det"] == (3, ref1)  # v1's bytes as v3
    assert all(spec.model == ref1 for spec in canary.specs.values())
    assert all(e.version == 3 and e.status == "running" for e in canary.sim.controller.workloads.values())
    assert set(sim.published_at[2]) == {"site-000"}
    for name, s in sim.sites.items():
        if name != "site-000":
            assert s.releases["det"] == (1, ref1) and not s.accepted_at and not s.refusals
            assert all(e.version == 1 for e in s.sim.controller.workloads.values())
    assert [x["state"] for x in ro["timeline"][1:]] == ["waiting"] * 4


def test_a_site_cut_during_the_rollout_is_skipped_and_catches_up_when_the_link_returns(tmp_path):
    # one cut site never holds the fleet: it times out, the others get the release, it catches up later
    ev = _event(200, "cut", ["site-002"]) + _event(900, "restore", ["site-002"])
    sim, r = _sim(tmp_path, events=ev)
    ro = r.rollout
    rows = {x["site"]: x for x in ro["timeline"]}
    assert ro["step"] == "done" and ro["reason"] == ""   # nothing missing any more
    others = [n for n in rows if n != "site-002"]
    assert all(rows[n]["state"] == "accepted" and rows[n]["accepted_s"] < 900 for n in others)
    assert rows["site-002"]["state"] == "accepted"          # caught up ...
    assert rows["site-002"]["accepted_s"] >= 900             # ... once its link came back
    assert sim.sites["site-002"].releases["det"][0] == 2


def test_a_canary_cut_during_its_check_holds_the_rollout(tmp_path):
    ev = _event(250, "cut", ["site-000"]) + _event(700, "restore", ["site-000"])
    _, r = _sim(tmp_path, events=ev)
    ro = r.rollout
    assert ro["step"] == "done" and ro["rollback"] is None, ro["reason"]
    rows = {x["site"]: x for x in ro["timeline"]}
    assert rows["site-000"]["accepted_s"] >= 700
    assert all(x["state"] == "accepted" for x in rows.values())


def test_a_canary_cut_for_longer_than_the_outage_grace_fails_the_check(tmp_path):
    ev = _event(250, "cut", ["site-000"]) + _event(1100, "restore", ["site-000"])
    sim, r = _sim(tmp_path, events=ev, rollout="outage_grace_s = 60")  # after 60 s its timeouts run again
    ro = r.rollout
    assert ro["step"] in ("failed", "rolled back"), ro
    for name, s in sim.sites.items():
        if name != "site-000":
            assert s.releases["det"][0] == 1


def test_scenario_errors_name_the_field(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(_toml(events=_event(10, "cut", ["site-009"])))
    with pytest.raises(ScenarioError, match=r"sites.events\[0\].sites"):
        run_multisite(load_scenario(p), clock=_fake_clock())
    p.write_text(_toml(check="maybe"))
    with pytest.raises(ScenarioError, match="canary_check"):
        run_multisite(load_scenario(p), clock=_fake_clock())
    p.write_text(_toml().replace("[sites.rollout]", "[sites.rollout]\nnope = 1"))
    with pytest.raises(ScenarioError, match=r"sites\.rollout: unknown rollout setting 'nope'"):
        run_multisite(load_scenario(p), clock=_fake_clock())
    p.write_text(_toml(extra="pol_s = 3"))
    with pytest.raises(ScenarioError, match=r"sites\.pol_s: unknown key"):
        run_multisite(load_scenario(p), clock=_fake_clock())


def test_builtin_hundred_sites_scenario_parses():
    sc = load_scenario("hundred-sites")
    cfg = parse_sites(sc.sites)
    assert cfg.count == 100 and cfg.canary == "site-000" and sc.devices == 1000
    assert cfg.release is not None and cfg.release.canary_check == "pass"
    assert {e.kind for e in cfg.events} == {"cut", "crash", "restore"}


def test_cli_simulates_a_multisite_scenario(tmp_path, capsys):
    import argparse

    from simulations.cli import register

    p = tmp_path / "s.toml"
    p.write_text(_toml(sites=3, devices=30, duration=600))
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    args = ap.parse_args(["simulate", str(p), "--json", "--sites", "2"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sites"] == 2 and out["devices"] == 60 and out["rollout"]["step"] == "done"


def test_fewer_sites_than_the_scenario_keeps_only_their_events(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(_toml(duration=400, events=_event(100, "cut", ["site-001", "site-004"])
                       + _event(200, "restore", ["site-004"])))
    s = run_multisite(load_scenario(p), clock=_fake_clock(), sites=3).summary()
    assert s["sites"] == 3 and [c["site"] for c in s["cuts"]] == ["site-001"]


def test_a_full_outbox_drops_the_oldest_summaries():
    from simulations.wan import SiteSummary, WanLink

    link = WanLink("s", max_queued=3)
    assert link.send(SiteSummary("s", 0.0, 1, 1, 1, 0))
    link.cut(1.0, repairs=0)
    for t in range(2, 7):
        assert not link.send(SiteSummary("s", float(t), 1, 1, 1, 0))
    assert link.queued == 5 and link.dropped == 2
    drained = link.restore(9.0, repairs=4)
    assert [x.at_s for x in drained] == [4.0, 5.0, 6.0]  # the newest kept, in order
    assert link.drained == 3 and link.delivered == 4 and link.cuts[0].repairs_after == 4
    assert link.restore(10.0, repairs=4) == []  # already up

"""The staged rollout machine (pure): table-driven scenarios, time advanced by hand, JSON round trips."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from cloud_coordinator.rollout import (
    Lost,
    NewRelease,
    Note,
    Probe,
    ProbeDone,
    ProbeSample,
    Publish,
    Restore,
    Restored,
    RestoreFailed,
    RolloutBook,
    RolloutPolicy,
    Seen,
    SiteView,
    Step,
    WorkloadView,
    compare_outputs,
    judge_probe,
    model_ref,
    site_view,
)
from runtime.errors import LocalViolation

SHA = {v: f"{v:x}" * 64 for v in range(1, 10)}
REF = {v: model_ref(SHA[v][:64]) for v in SHA}


def rel(v: int) -> NewRelease:
    return NewRelease("m", v, SHA[v][:64], f"m-v{v:09d}.release")


def wl(version: int, model: int, *, status: str = "running", healthy: int = 1, replicas: int = 1,
       predicted: float | None = 0.01, devices: tuple[int, ...] | None = None, name: str = "w") -> WorkloadView:
    return WorkloadView(name, REF[model], version, status, healthy, replicas, predicted, "",
                        devices if devices is not None else (version,))


def view(release: int | None = None, *wls: WorkloadView, refusals: dict[str, int] | None = None,
         ref: str | None = None) -> SiteView:
    rels = {"m": (release, ref or REF[release])} if release is not None else {}
    return SiteView(rels, tuple(wls), refusals or {})


def ok(n: int = 4, lat: float = 0.012, w: str = "w") -> tuple[ProbeSample, ...]:
    return tuple(ProbeSample(w, True, "", "", lat) for _ in range(n))


@dataclass
class H:
    """Drives one book: events and ticks at hand-set times; every command kept."""

    book: RolloutBook
    now: float = 0.0

    def __post_init__(self) -> None:
        self.cmds: list[Any] = []

    def __call__(self, step: Any) -> list[Any]:
        if isinstance(step, (int, float)):   # a number: let that many seconds pass, then tick
            self.now += step
            out = self.book.tick(self.now)
        else:
            out = self.book.handle(step, self.now)
        self.cmds += out
        return out

    @property
    def published(self) -> list[tuple[str, int]]:
        return [(c.site, c.version) for c in self.cmds if isinstance(c, Publish)]

    def of(self, kind: type) -> list[Any]:
        return [c for c in self.cmds if isinstance(c, kind)]


def harness(sites: tuple[str, ...] = ("a", "b", "c"), **policy: Any) -> H:
    return H(RolloutBook(list(sites), sites[0], RolloutPolicy(**policy)))


# A canary "a" that runs m v1 with workload w (its v3) following it, and v2 on the way.
BASE = view(1, wl(3, 1))
SWITCHED = view(2, wl(4, 2))
# The canary lists a first release, holds (nothing serves it), then its operator's release:m workload runs it.
FIRST = [Seen("a", view(1)), Seen("a", view(1, wl(1, 1))), ProbeDone("m", 1, ok())]

SCENARIOS: list[tuple[str, list[Any], Step, str, list[tuple[str, int]]]] = [
    ("first release: held until a workload serves it at the canary, checked, accepted everywhere",
     [rel(1), Seen("a", view()), *FIRST, Seen("b", view(1)), Seen("c", view(1))],
     Step.DONE, "", [("a", 1), ("b", 1), ("c", 1)]),
    ("first release nothing ever serves at the canary: held, never sent on, fails at the serve timeout",
     [rel(1), Seen("a", view()), Seen("a", view(1)), Seen("b", view()), 121.0],
     Step.FAILED, "serves no workload from release:m, so outputs and latency cannot be checked", [("a", 1)]),
    ("canary switched and probed, then the others in order",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok()), Seen("c", view(1)),
      Seen("b", view(2)), Seen("c", view(2))],
     Step.DONE, "", [("a", 2), ("b", 2), ("c", 2)]),
    ("outputs differ: rolled back, the others never get it",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED),
      ProbeDone("m", 2, ok(3) + (ProbeSample("w", True, "", "output 'y' differs (max |err| 0.9)", 0.01),)),
      Restored("m", 2, 3, 1), Seen("a", view(3, wl(5, 1)))],
     Step.ROLLED_BACK, "1/4 held-out outputs differ from the coordinator's run (w: output 'y' differs",
     [("a", 2), ("a", 3)]),
    ("a held-out request failed: rolled back",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED),
      ProbeDone("m", 2, ok(3) + (ProbeSample("w", False, "timed out"),)), Restored("m", 2, 3, 1), Seen("a", view(3))],
     Step.ROLLED_BACK, "1/4 held-out requests failed (w: timed out)", [("a", 2), ("a", 3)]),
    ("slower than the plan allows: rolled back",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok(lat=0.5)), Restored("m", 2, 3, 1),
      Seen("a", view(3))],
     Step.ROLLED_BACK, "p50 latency 500.0 ms is over 3 x the predicted 10.0 ms", [("a", 2), ("a", 3)]),
    ("the workload never redeploys (same version): serve timeout, rolled back",
     [rel(2), Seen("a", BASE), Seen("a", view(2, wl(3, 2))), 121.0, Restored("m", 2, 3, 1), Seen("a", view(3))],
     Step.ROLLED_BACK, "does not serve m v2 after 120 s (w: not redeployed (still its v3))", [("a", 2), ("a", 3)]),
    ("pending at the canary: serve timeout names the reason",
     [rel(2), Seen("a", BASE), Seen("a", view(2, wl(4, 2, status="pending", healthy=0))), 121.0,
      Restored("m", 2, 3, 1), Seen("a", view(3))],
     Step.ROLLED_BACK, "w: pending", [("a", 2), ("a", 3)]),
    ("devices still report the old version: not switched yet",
     [rel(2), Seen("a", BASE), Seen("a", view(2, wl(4, 2, devices=(3, 4)))), 121.0, Restored("m", 2, 3, 1),
      Seen("a", view(3))],
     Step.ROLLED_BACK, "devices still run its v3", [("a", 2), ("a", 3)]),
    ("the same bytes as the canary's v1 under v2 (issue 28): unchanged, nothing published, nothing rolled back",
     [rel(2), Seen("a", view(1, wl(3, 2), ref=REF[2]))],
     Step.UNCHANGED, "unchanged, not released: canary a already runs these bytes as v1", []),
    ("the canary refuses it: failed, nothing to roll back, nobody else gets it",
     [rel(2), Seen("a", BASE), Seen("a", view(1, wl(3, 1), refusals={"release:bad signature": 1}))],
     Step.FAILED, "canary a refused m v2: bad signature", [("a", 2)]),
    ("a stale refusal is a duplicate, not ours",
     [rel(2), Seen("a", BASE), Seen("a", view(1, wl(3, 1), refusals={"release:stale": 1})), Seen("a", SWITCHED),
      ProbeDone("m", 2, ok()), Seen("b", view(2)), Seen("c", view(2))],
     Step.DONE, "", [("a", 2), ("b", 2), ("c", 2)]),
    ("canary unreachable before anything was published",
     [rel(2), Lost("a", "MQTT cloud -> 10.0.0.1:8883: connection refused"), 31.0],
     Step.FAILED, "canary a did not answer within 30 s (last error: MQTT cloud -> 10.0.0.1:8883: connection refused)"
                  "; m v2 was not released anywhere", []),
    ("the canary never lists it and there is no earlier release",
     [rel(1), Seen("a", view()), 31.0],
     Step.FAILED, "no earlier release of m to roll back to: canary a keeps v1", [("a", 1), ("a", 1), ("a", 1),
                                                                                 ("a", 1)]),
    ("a site that does not confirm is skipped; the next one gets it",
     [rel(1), Seen("a", view()), *FIRST, Lost("b", "no status answer"), 31.0, Seen("c", view(1))],
     Step.DONE, "b: timeout (did not list v1 within 30 s (last error: no status answer))",
     [("a", 1), ("b", 1), ("b", 1), ("b", 1), ("b", 1), ("c", 1)]),
    ("a site that refuses it is recorded; the next one gets it",
     [rel(1), Seen("b", view()), Seen("a", view()), *FIRST,
      Seen("b", view(refusals={"release:signer is not a pinned coordinator": 1})), Seen("c", view(1))],
     Step.DONE, "b: refused (signer is not a pinned coordinator)", [("a", 1), ("b", 1), ("c", 1)]),
    ("the rollback is not confirmed in time",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok(lat=0.5)), Restored("m", 2, 3, 1), 61.0],
     Step.FAILED, "the rollback to v1's model (v3) was not confirmed within 60 s: canary a may still run v2",
     [("a", 2), ("a", 3), ("a", 3), ("a", 3), ("a", 3), ("a", 3), ("a", 3), ("a", 3)]),
    ("the rollback file cannot be written",
     [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok(lat=0.5)),
      RestoreFailed("m", 2, "no outbox file of v1")],
     Step.FAILED, "cannot roll back (no outbox file of v1): canary a keeps v2", [("a", 2)]),
    ("the canary already has a newer version",
     [rel(2), Seen("a", view(5))],
     Step.FAILED, "canary a already lists m v5, newer than v2; nothing was released", []),
    ("the canary lists this version with other bytes",
     [rel(2), Seen("a", view(2, ref=REF[7]))],
     Step.FAILED, "already lists m v2 with other bytes", []),
    ("a workload deleted mid-rollout is dropped from the check: nothing left to check, held, rolled back",
     [rel(2), Seen("a", BASE), Seen("a", view(2)), Seen("b", view(2)), 121.0, Restored("m", 2, 3, 1),
      Seen("a", view(3))],
     Step.ROLLED_BACK, "serves no workload from release:m", [("a", 2), ("a", 3)]),
]


@pytest.mark.parametrize("name,steps,step,reason,published", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_scenarios(name: str, steps: list[Any], step: Step, reason: str, published: list[tuple[str, int]]) -> None:
    h = harness()
    for s in steps:
        if isinstance(s, (int, float)):   # long waits: tick every 10 s like the adapter would
            for _ in range(int(s // 10)):
                h(10.0)
            h(s % 10 or 0.0)
        else:
            h(s)
    r = h.book.rollouts[-1]
    assert r.step is step, (r.step, r.reason, h.cmds)
    assert reason in r.reason, r.reason
    assert h.published == published
    assert not h.book.busy
    if step is Step.DONE:
        assert h.book.good["m"] == r.version
    else:
        assert h.book.good.get("m") != r.version


def test_probe_carries_the_followers_and_the_latency_check_uses_the_plan() -> None:
    h = harness(latency_factor=2.0, latency_slack_s=0.0)
    h(rel(2))
    h(Seen("a", view(1, wl(3, 1), wl(1, 1, name="w2"), wl(1, 9, name="other"))))
    h(Seen("a", view(2, wl(4, 2), wl(2, 2, name="w2"), wl(1, 9, name="other"))))
    probe = h.of(Probe)
    assert probe == [Probe("a", "m", 2, ("w", "w2"))]
    h(ProbeDone("m", 2, ok(w="w") + ok(w="w2", lat=0.021)))   # 2 x 10 ms < 21 ms
    r = h.book.rollouts[-1]
    assert r.step is Step.ROLLBACK and "w2: p50 latency 21.0 ms is over 2 x the predicted 10.0 ms" in r.cause
    assert h.of(Restore) == [Restore("m", 2, (1,))]


def test_require_serving_fails_a_canary_that_serves_nothing() -> None:
    h = harness(require_serving=True)
    h(rel(1))
    h(Seen("a", view()))
    h(Seen("a", view(1)))
    r = h.book.rollouts[-1]
    assert r.step is Step.FAILED and "serves no workload from release:m" in r.reason
    assert h.published == [("a", 1)]


def test_a_newer_queued_release_supersedes_older_ones_and_waits_its_turn() -> None:
    h = harness(sites=("a",), allow_unchecked_canary=True)
    h(rel(1))
    h(rel(2))
    h(rel(3))
    assert [r.step for r in h.book.rollouts] == [Step.BASELINE, Step.QUEUED, Step.QUEUED]
    h(Seen("a", view()))
    h(Seen("a", view(1)))
    assert h.book.rollouts[0].step is Step.DONE
    assert [r.step for r in h.book.rollouts[1:]] == [Step.SUPERSEDED, Step.BASELINE]
    h(Seen("a", view(1)))
    h(Seen("a", view(3)))
    assert h.book.rollouts[-1].step is Step.DONE and h.published == [("a", 1), ("a", 3)]
    h(rel(2))   # an old file turning up later is not rolled out
    assert not h.book.busy and h.published == [("a", 1), ("a", 3)]


def test_publish_is_repeated_until_the_canary_lists_it() -> None:
    h = harness(publish_retry_s=5.0)
    h(rel(1))
    h(Seen("a", view()))
    for _ in range(4):
        h(2.5)
    assert h.published == [("a", 1)] * 3


def test_adopted_releases_count_as_good() -> None:
    h = harness()
    h(NewRelease("m", 1, SHA[1][:64], "m-v000000001.release", published=True))
    assert h.book.rollouts[0].step is Step.DONE and h.book.good == {"m": 1} and not h.published
    # the canary never lists v2 and had no version of m before: the rollback goes to the adopted v1
    h(rel(2))
    h(Seen("a", view()))
    for _ in range(4):
        h(10.0)
    assert h.of(Restore) == [Restore("m", 2, (1,))] and h.book.rollouts[-1].step is Step.ROLLBACK
    assert "canary a did not list m v2 within 30 s" in h.book.rollouts[-1].cause


@pytest.mark.parametrize("at", ["canary", "switch", "probe", "rolling", "rollback"])
def test_the_book_survives_a_restart_at_every_step(at: str) -> None:
    """Save the book as JSON mid-rollout, load it in a fresh book, resume: the rollout ends as it would have."""
    steps: list[Any] = [rel(2), Seen("a", BASE)]
    if at in ("switch", "probe", "rolling", "rollback"):
        steps.append(Seen("a", view(2, wl(4, 2, status="pending", healthy=0))))
    if at in ("probe", "rolling", "rollback"):
        steps.append(Seen("a", SWITCHED))
    if at == "rolling":
        steps.append(ProbeDone("m", 2, ok()))
    if at == "rollback":
        steps += [ProbeDone("m", 2, ok(lat=1.0)), Restored("m", 2, 3, 1)]
    h = harness()
    for s in steps:
        h(s)
    doc = json.loads(json.dumps(h.book.to_json()))
    h2 = H(RolloutBook.from_json(doc, ["a", "b", "c"], "a", RolloutPolicy()), now=1000.0)
    out = h2.book.resume(h2.now)
    h2.cmds += out
    r = h2.book.active
    assert r is not None and r.step.value == at
    if at == "canary":
        assert Publish("a", "m", 2) in out
        h2(Seen("a", view(2, wl(3, 1))))
    if at in ("canary", "switch"):
        h2(Seen("a", SWITCHED))
    if at == "probe":
        assert Probe("a", "m", 2, ("w",)) in out
        h2(Seen("a", SWITCHED))   # a status after the restart: the plan's prediction the latency is judged by
    if at in ("canary", "switch", "probe"):
        h2(ProbeDone("m", 2, ok()))
    if at == "rollback":
        assert Publish("a", "m", 3) in out
        h2(Seen("a", view(3)))
        assert h2.book.rollouts[-1].step is Step.ROLLED_BACK
        return
    assert Publish("b", "m", 2) in h2.cmds
    h2(Seen("b", view(2)))
    h2(Seen("c", view(2)))
    assert h2.book.rollouts[-1].step is Step.DONE


def test_resume_fails_a_rollout_whose_canary_was_removed() -> None:
    h = harness()
    h(rel(2))
    h(Seen("a", BASE))
    book = RolloutBook.from_json(h.book.to_json(), ["b", "c"], "b")
    out = book.resume(0.0)
    assert book.rollouts[-1].step is Step.FAILED and "canary a is no longer a configured site" in \
        book.rollouts[-1].reason and not [c for c in out if isinstance(c, Publish)]


@pytest.mark.parametrize("doc", [{}, {"format": 2}, {"format": 1, "rollouts": [{"name": "m"}]},
                                 {"format": 1, "rollouts": [{"name": "m", "version": 1, "sha256": "x", "file": "f",
                                                             "step": "flying"}]}, [], "x"])
def test_a_bad_book_is_refused(doc: Any) -> None:
    with pytest.raises(ValueError):
        RolloutBook.from_json(doc, ["a"], "a")


def test_book_needs_a_known_canary() -> None:
    with pytest.raises(LocalViolation, match="unknown canary site 'x' \\(sites: a, b\\)"):
        RolloutBook(["a", "b"], "x")


# ------------------------------------------------------------------ pieces


def test_site_view_reads_a_fog_status() -> None:
    st = {"releases": {"m": {"version": 4, "model": "file:abc", "signer": "cloud"}, "bad": {"version": "x"}},
          "workloads": [{"name": "w", "version": 2, "status": "running", "model": "file:abc", "healthy_replicas": 2,
                         "replicas": 2, "latency": {"predicted_s": 0.004, "measured_p50_s": 0.01}, "reasons": {}},
                        {"name": "p", "version": 1, "status": "pending", "model": "zoo:mlp", "healthy_replicas": 0,
                         "replicas": 1, "latency": {"predicted_s": None}, "reasons": {"placement": "no fit"}},
                        "junk"],
          "devices": [{"id": "d1", "partitions": ["w/v2/r0/p0:running", "w/v1/r1/p0:running", "junk"]}],
          "counters": {"release:stale": 2, "releases": 4, "release:bad signature": 1}}
    v = site_view(st)
    assert v.releases == {"m": (4, "file:abc")}
    assert v.workload("w") == WorkloadView("w", "file:abc", 2, "running", 2, 2, 0.004, "", (2, 1))
    assert v.workload("p").reasons == "placement: no fit" and v.workload("p").predicted_s is None
    assert v.refusals == {"release:stale": 2, "release:bad signature": 1}
    assert v.workload("w").switched_to("file:abc", 1) == "devices still run its v1"
    sw = site_view({**st, "devices": [], "workloads": [{**st["workloads"][0], "switch": {
        "from_version": 1, "to_version": 2, "mode": "make-before-break", "old_partitions": []}}]})
    assert sw.workload("w").switched_to("file:abc", 1) == "switch v1 -> v2 in progress"
    with pytest.raises(ValueError):
        site_view(["not", "a", "status"])  # type: ignore[arg-type]


@pytest.mark.parametrize("want,got,why", [
    ({"y": np.ones((1, 3), np.float32)}, {"y": np.ones((1, 3), np.float32) + 1e-7}, ""),
    ({"y": np.ones((1, 3), np.float32)}, {"y": np.ones((1, 3), np.float32) + 1e-2},
     "output 'y' differs (max |err| 0.01)"),
    ({"y": np.ones((1, 3), np.float32)}, {}, "output 'y' missing"),
    ({"y": np.ones((1, 3), np.float32)}, {"y": np.ones((3,), np.float32)}, "output 'y' has shape [3], not [1, 3]"),
    ({"k": np.array([1, 2])}, {"k": np.array([1, 3])}, "output 'k' differs"),
    ({"y": np.array([np.nan])}, {"y": np.array([np.nan])}, ""),
])
def test_compare_outputs(want: Any, got: Any, why: str) -> None:
    assert compare_outputs(want, got, 1e-4, 1e-5) == why


def test_judge_probe_phrases() -> None:
    p = RolloutPolicy()
    assert judge_probe([], {}, p) == (False, "no held-out request could be sent")
    good, text = judge_probe(ok(), {"w": None}, p)
    assert good and text == "held-out batch: 4/4 answered, outputs equal; w p50 12.0 ms (no prediction)"


@pytest.mark.parametrize("pairs,msg", [
    (["nope=1"], "unknown rollout setting 'nope'"),
    (["latency_factor=0.5"], "latency_factor must be >= 1"),
    (["serve_timeout_s=-1"], "serve_timeout_s must be a number of seconds"),
    (["require_serving=maybe"], "require_serving: 'maybe' is not a bool"),
    (["probe_requests=x"], "probe_requests: 'x' is not a int"),
    (["novalue"], "expected KEY=VALUE"),
])
def test_policy_settings_are_checked(pairs: list[str], msg: str) -> None:
    with pytest.raises(LocalViolation, match=msg.replace("(", "\\(").replace(")", "\\)")):
        RolloutPolicy.from_pairs(pairs)


def test_policy_settings_parse() -> None:
    p = RolloutPolicy.from_pairs(["serve-timeout-s=5", "require_serving=true", "probe_requests=3", "holdout=x.npz"])
    assert (p.serve_timeout_s, p.require_serving, p.probe_requests, p.holdout) == (5.0, True, 3, "x.npz")


def test_notes_say_what_happened() -> None:
    h = harness(sites=("a", "b"))
    for s in [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok()), Seen("b", view(2))]:
        h(s)
    texts = [n.text for n in h.of(Note)]
    assert texts[0] == "m v2: queued for a staged rollout"
    assert "m v2: staged rollout: canary a, then b" in texts
    assert "m v2: published to canary a (it runs v1; it serves w from the release)" in texts
    assert texts[-1] == "m v2: rolled out to a, b"


def test_a_site_that_timed_out_catches_up_when_it_answers_again() -> None:
    h = harness(site_timeout_s=30.0, publish_retry_s=10.0)
    for s in [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok())]:
        h(s)
    h(31.0)  # b never answered: timed out, the release goes on to c
    h(Seen("c", view(2)))
    r = h.book.find("m", 2)
    assert r is not None and r.step is Step.DONE and r.sites["b"].state == "timeout"
    before = len(h.published)
    h(Seen("b", view(1)))  # b is back, still on v1: published there again
    assert h.published[before:] == [("b", 2)] and r.sites["b"].state == "catching up"
    h(Seen("b", view(1)))  # not before publish_retry_s
    assert h.published[before:] == [("b", 2)]
    h(11.0)
    h(Seen("b", view(1)))
    assert h.published[before:] == [("b", 2), ("b", 2)]
    h(Seen("b", view(2)))
    assert r.sites["b"].state == "accepted" and "caught up" in r.sites["b"].detail
    assert any("site b caught up" in n.text for n in h.of(Note))
    h(Seen("b", view(2)))  # nothing more to do
    assert h.published[before:] == [("b", 2), ("b", 2)]


def test_catch_up_never_pushes_a_release_the_site_refused() -> None:
    h = harness(site_timeout_s=30.0)
    for s in [rel(2), Seen("b", view(1)), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok())]:
        h(s)
    h(Seen("b", view(1, refusals={"release:bad signature": 1})))  # b refused v2
    h(31.0)   # c timed out
    r2 = h.book.find("m", 2)
    assert r2 is not None and r2.sites["b"].state == "refused" and r2.sites["c"].state == "timeout"
    before = len(h.published)
    h(Seen("b", view(1, refusals={"release:bad signature": 1})))
    assert h.published[before:] == []  # a refusal is the site's verdict: not pushed again
    h(Seen("c", view(1)))
    assert h.published[before:] == [("c", 2)]


def test_a_caught_up_site_leaves_the_rollouts_reason() -> None:
    h = harness(site_timeout_s=30.0)
    for s in [rel(2), Seen("a", BASE), Seen("a", SWITCHED), ProbeDone("m", 2, ok()), 31.0, Seen("c", view(2))]:
        h(s)
    r = h.book.find("m", 2)
    assert r is not None and "b: timeout" in r.reason
    h(Seen("b", view(2)))
    assert r.reason == ""

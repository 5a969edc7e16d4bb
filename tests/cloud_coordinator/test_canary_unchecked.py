"""A canary step that cannot check outputs or latency holds, unless the policy says so explicitly (pure core).

Issue 20 finding 9: a canary that "serves no workload from release: outputs and latency not checked"
was marked done and the release sent on to the next site.
"""
from __future__ import annotations

from typing import Any

from cloud_coordinator.rollout import (
    NewRelease,
    Note,
    Probe,
    ProbeDone,
    ProbeSample,
    Publish,
    RolloutBook,
    RolloutPolicy,
    Seen,
    SiteView,
    Step,
    WorkloadView,
    model_ref,
)

SHA1 = "1" * 64
REF1 = model_ref(SHA1)


def _book(**policy: Any) -> RolloutBook:
    return RolloutBook(["a", "b"], "a", RolloutPolicy(**policy))


def _listed(*wls: WorkloadView) -> SiteView:
    return SiteView({"m": (1, REF1)}, tuple(wls), {})


def _serving() -> WorkloadView:
    return WorkloadView("w", REF1, 1, "running", 1, 1, 0.01, "", (1,))


def _drive(book: RolloutBook, *events: Any, now: float = 0.0) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        out += book.handle(ev, now)
    return out


def test_an_unchecked_canary_holds_with_the_reason_in_the_status_and_is_not_sent_on() -> None:
    book = _book()
    cmds = _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()),
                  Seen("b", SiteView()))
    r = book.rollouts[0]
    assert r.step is Step.SWITCH and not book.good
    assert [c.site for c in cmds if isinstance(c, Publish)] == ["a"]          # never sent on to b
    status = book.to_json()["rollouts"][0]
    assert "held: canary a serves no workload from release:m" in status["waiting_for"]
    assert "allow_unchecked_canary" in status["waiting_for"]
    assert not any("not checked" in c for c in status["checks"])
    warnings = [c for c in cmds if isinstance(c, Note) and c.level == "warning" and "held" in c.text]
    assert len(warnings) == 1
    # still holding later (a status again, ticks inside serve_timeout_s): no new note, nothing published
    later = _drive(book, Seen("a", _listed()), now=60.0) + book.tick(100.0)
    assert not [c for c in later if isinstance(c, (Publish, Note))]
    # survives a coordinator restart
    again = RolloutBook.from_json(book.to_json(), ["a", "b"], "a")
    assert again.rollouts[0].step is Step.SWITCH and "held" in again.rollouts[0].waiting_for


def test_a_held_canary_is_checked_once_a_workload_there_runs_the_release() -> None:
    book = _book()
    _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()))
    cmds = _drive(book, Seen("a", _listed(_serving())), now=5.0)
    assert Probe("a", "m", 1, ("w",)) in cmds
    r = book.rollouts[0]
    assert r.step is Step.PROBE and r.baseline is not None and r.baseline["followers"] == {"w": None}
    cmds = _drive(book, ProbeDone("m", 1, tuple(ProbeSample("w", True, "", "", 0.012) for _ in range(4))),
                  now=6.0)
    assert [c.site for c in cmds if isinstance(c, Publish)] == ["b"]
    assert any(c.startswith("held-out batch: 4/4 answered") for c in r.checks)


def test_a_held_canary_that_never_serves_fails_at_the_serve_timeout() -> None:
    book = _book(serve_timeout_s=30.0)
    _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()))
    assert book.tick(20.0) == []
    book.tick(31.0)
    r = book.rollouts[0]
    assert r.step is Step.FAILED and "outputs and latency cannot be checked" in r.reason, r.reason
    assert "m" not in book.good


def test_allow_unchecked_canary_true_goes_on_and_says_so() -> None:
    policy = RolloutPolicy.from_pairs(["allow_unchecked_canary=true"])
    assert policy.allow_unchecked_canary and not RolloutPolicy().allow_unchecked_canary
    assert RolloutPolicy.from_mapping({"allow-unchecked-canary": True}).allow_unchecked_canary
    book = RolloutBook(["a", "b"], "a", policy)
    cmds = _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()),
                  Seen("b", _listed()))
    r = book.rollouts[0]
    assert r.step is Step.DONE and book.good["m"] == 1
    assert [c.site for c in cmds if isinstance(c, Publish)] == ["a", "b"]
    assert any("outputs and latency not checked (allow_unchecked_canary = true)" in c for c in r.checks)


def test_require_serving_still_fails_at_once() -> None:
    book = _book(require_serving=True)
    _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()))
    assert book.rollouts[0].step is Step.FAILED


# ------------------------------------------------------------------ latency that cannot be checked

SHA2 = "2" * 64
REF2 = model_ref(SHA2)


def _v1_serving(predicted: float | None) -> SiteView:
    return SiteView({"m": (1, REF1)}, (WorkloadView("w", REF1, 3, "running", 1, 1, predicted, "", (3,)),), {})


def _v2_serving(predicted: float | None) -> SiteView:
    return SiteView({"m": (2, REF2)}, (WorkloadView("w", REF2, 4, "running", 1, 1, predicted, "", (4,)),), {})


def _probed_without_prediction(**policy: Any) -> tuple[RolloutBook, list[Any]]:
    book = _book(**policy)
    cmds = _drive(book, NewRelease("m", 2, SHA2, "m-v2.release"), Seen("a", _v1_serving(0.01)),
                  Seen("a", _v2_serving(None)))
    assert Probe("a", "m", 2, ("w",)) in cmds
    cmds += _drive(book, ProbeDone("m", 2, tuple(ProbeSample("w", True, "", "", 0.012) for _ in range(4))))
    return book, cmds


def test_a_probe_whose_latency_has_no_prediction_holds_until_one_is_reported() -> None:
    book, cmds = _probed_without_prediction()
    r = book.rollouts[0]
    assert r.step is Step.PROBE and [c.site for c in cmds if isinstance(c, Publish)] == ["a"]
    status = book.to_json()["rollouts"][0]
    assert "held: canary a has no latency prediction for w" in status["waiting_for"]
    again = RolloutBook.from_json(book.to_json(), ["a", "b"], "a")   # the hold survives a restart
    assert again.rollouts[0].baseline is not None and again.rollouts[0].baseline["probe_samples"]
    # the fog reports the plan's prediction: the same samples are judged, and the release goes on
    cmds = _drive(book, Seen("a", _v2_serving(0.01)), now=3.0)
    assert [c.site for c in cmds if isinstance(c, Publish)] == ["b"]
    assert any("w p50 12.0 ms (predicted 10.0 ms)" in c for c in r.checks), r.checks


def test_a_held_probe_that_is_too_slow_once_predicted_is_rolled_back() -> None:
    book, _ = _probed_without_prediction()
    _drive(book, Seen("a", _v2_serving(0.001)), now=3.0)   # 12 ms > 3 x 1 ms + 50 ms? no: 53 ms bound
    assert book.rollouts[0].step is Step.ROLLING
    book, _ = _probed_without_prediction(latency_slack_s=0.0)
    _drive(book, Seen("a", _v2_serving(0.001)), now=3.0)   # 12 ms > 3 x 1 ms
    r = book.rollouts[0]
    assert r.step is Step.ROLLBACK and "p50 latency 12.0 ms is over 3 x the predicted 1.0 ms" in r.cause


def test_a_held_probe_without_prediction_rolls_back_at_the_probe_timeout() -> None:
    book, _ = _probed_without_prediction(probe_timeout_s=20.0)
    book.tick(61.0)
    r = book.rollouts[0]
    assert r.step is Step.ROLLBACK and "no latency prediction for w" in r.cause, r.cause


def test_allow_unchecked_canary_accepts_a_latency_without_prediction_and_says_so() -> None:
    book, cmds = _probed_without_prediction(allow_unchecked_canary=True)
    r = book.rollouts[0]
    assert r.step is Step.ROLLING and [c.site for c in cmds if isinstance(c, Publish)] == ["a", "b"]
    assert any("(no prediction)" in c and "latency not checked: allow_unchecked_canary = true" in c
               for c in r.checks), r.checks


def test_a_lone_site_is_not_held_for_a_check_that_would_protect_no_other_site() -> None:
    """One site: the release must reach it before a ``release:`` workload can follow it; a hold
    would only block that deploy (nothing to hold the release back from), so it goes on and says so."""
    book = RolloutBook(["a"], "a", RolloutPolicy())
    _drive(book, NewRelease("m", 1, SHA1, "m-v1.release"), Seen("a", SiteView()), Seen("a", _listed()))
    r = book.rollouts[0]
    assert r.step is not Step.SWITCH and "held" not in (r.waiting_for or "")
    assert any("it is the only site" in c for c in r.checks)

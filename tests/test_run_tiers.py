"""``tests/run_tiers.py``: every test lands in exactly one step, and ``nightly`` giants in none of
``make test``'s."""
from __future__ import annotations

import pytest
from _pytest.mark.expression import Expression
from run_tiers import MAKE_TEST, main, steps

# the markers a test carries once conftest gave ``slow`` and ``nightly`` tests the ``e2e`` one
KINDS = {
    "unit": set(),
    "integration": {"integration"},
    "serial": {"integration", "serial"},
    "e2e": {"integration", "slow", "e2e"},
    "nightly": {"integration", "slow", "e2e", "nightly"},
}


def _selected_by(markers: set[str]) -> list[str]:
    return [name for name, step in steps(2, 2).items()
            if Expression.compile(step.markers).evaluate(lambda m: m in markers)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_test_runs_in_its_own_step_only(kind: str) -> None:
    assert _selected_by(KINDS[kind]) == [kind]


def test_make_test_runs_no_nightly_giant(capsys: pytest.CaptureFixture[str]) -> None:
    assert "nightly" not in MAKE_TEST and set(MAKE_TEST) < set(steps(2, 2))
    with pytest.raises(SystemExit):
        main(["--tiers", "nope"])
    assert "one of unit, integration, serial, e2e, nightly" in capsys.readouterr().err

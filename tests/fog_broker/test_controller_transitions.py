"""The version switch's transition table: every mode change goes through it, and only its pairs."""
from __future__ import annotations

import itertools

import pytest

from fog_broker.controller import (
    BREAK_BEFORE_MAKE,
    MAKE_BEFORE_BREAK,
    ROLLING,
    TRANSITIONS,
    Step,
    Switch,
)
from fog_broker.controller.switch import step

MODES = (MAKE_BEFORE_BREAK, ROLLING, BREAK_BEFORE_MAKE)


@pytest.mark.parametrize(("mode", "s"), list(itertools.product(MODES, Step)))
def test_a_step_moves_a_switch_as_the_table_says_or_raises(mode: str, s: Step) -> None:
    sw = Switch(1, 2, None, mode=mode)
    if (mode, s) in TRANSITIONS:
        step(sw, s)
        assert sw.mode == TRANSITIONS[mode, s]
    else:
        with pytest.raises(ValueError, match=f"cannot {s.value}"):
            step(sw, s)
        assert sw.mode == mode  # an illegal step changes nothing


def test_every_mode_is_reached_from_make_before_break_and_every_step_is_used() -> None:
    seen, todo = {MAKE_BEFORE_BREAK}, [MAKE_BEFORE_BREAK]
    while todo:
        m = todo.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src == m and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    assert seen == set(MODES)
    assert {s for _, s in TRANSITIONS} == set(Step)
    # a new version resets every mode; breaking is only ever the last resort of a rolling switch
    assert all(TRANSITIONS[m, Step.BEGIN] == MAKE_BEFORE_BREAK for m in MODES)
    assert [src for (src, s) in TRANSITIONS if s is Step.BREAK] == [ROLLING]

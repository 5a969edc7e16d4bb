"""The fog's calibration of cut wires (``fog_broker.wires``) on a real two-partition chain."""
from __future__ import annotations

import pytest

from edge_agent.testing import tiny_chain
from fog_broker.wires import CALIB_FRAMES, CALIB_FRAMES_MAX, calibrate_chain, calibration_size
from runtime.activations import AccuracyBound


@pytest.mark.parametrize("bound,frames", [
    (AccuracyBound(), CALIB_FRAMES),
    (AccuracyBound(max_rel_error=1e-3), CALIB_FRAMES),     # an error bound averages every element
    (AccuracyBound(min_top1=0.5), CALIB_FRAMES),
    (AccuracyBound(min_top1=0.9), 10),
    (AccuracyBound(min_top1=0.99), 100),                    # one changed answer in 100 shows
    (AccuracyBound(min_top1=0.999), CALIB_FRAMES_MAX),
    (AccuracyBound(min_top1=1.0), CALIB_FRAMES_MAX),
])
def test_a_top1_bound_gets_enough_frames_to_see_one_changed_answer(bound: AccuracyBound,
                                                                    frames: int) -> None:
    assert calibration_size(bound) == frames


def test_the_chain_is_calibrated_on_as_many_frames_as_the_bound_needs() -> None:
    """8 frames at 100 % say nothing about 99 %: the report names the batch it was measured on."""
    parts = tiny_chain().parts
    rep = calibrate_chain(parts, AccuracyBound(min_top1=0.99))
    assert rep.frames == 100 and rep.to_dict()["calibration_frames"] == 100
    assert rep.top1 is not None and rep.top1 >= 0.99
    assert calibrate_chain(parts, AccuracyBound(max_rel_error=1e-3)).frames == CALIB_FRAMES
    assert calibrate_chain(parts, AccuracyBound(min_top1=0.99), frames=5).frames == 5

"""The kill phase's figures of ``fogline bench pipeline`` (``benchmarks.pipeline_bench.kill_figures``)
from answer times alone: no clock, no processes."""
from __future__ import annotations

import pytest

from benchmarks.pipeline_bench import kill_figures


def _every(start: float, stop: float, step: float) -> list[float]:
    return [start + i * step for i in range(round((stop - start) / step) + 1)]


def test_a_stall_after_the_kill_delays_the_rate_and_is_the_longest_gap() -> None:
    # 10 answers/s from 0 to 5, the kill at 5, nothing until 6.5, then 10/s again until 12
    times = _every(0.0, 5.0, 0.1) + _every(6.5, 12.0, 0.1)
    f = kill_figures(times, first=0.0, killed_at=5.0, stop_at=12.0)
    assert f["fps_before_kill"] == pytest.approx(10.0)
    assert f["max_gap_after_kill_s"] == pytest.approx(1.5)
    # the first 1 s window wholly after the kill with >= 9 answers ends at 6.5 + 0.8
    assert f["rate_back_after_s"] == pytest.approx(2.3)
    assert f["fps_after_recovery"] == pytest.approx(10.0, rel=0.05)


def test_no_stall_is_back_after_one_window_never_sooner() -> None:
    times = _every(0.0, 10.0, 0.1)
    f = kill_figures(times, first=0.0, killed_at=5.0, stop_at=10.0)
    assert f["rate_back_after_s"] == pytest.approx(1.0)
    assert f["max_gap_after_kill_s"] == pytest.approx(0.1)


def test_a_halved_rate_is_never_back() -> None:
    times = _every(0.0, 5.0, 0.1) + _every(5.2, 12.0, 0.2)
    f = kill_figures(times, first=0.0, killed_at=5.0, stop_at=12.0)
    assert f["rate_back_after_s"] is None and f["fps_after_recovery"] is None
    assert f["max_gap_after_kill_s"] == pytest.approx(0.2)

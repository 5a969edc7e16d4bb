"""``fogline bench budget --quiet-only`` measures what it says: every input kind, both ways, nothing
limited or refused in a quiet run (else the "on" figure would be the cost of a drop, not of a check)."""
from __future__ import annotations

import logging

from benchmarks.budget_bench import quiet_cost


def test_quiet_cost_measures_each_input_on_and_off() -> None:
    logging.disable(logging.WARNING)  # the bench's births are clamped on purpose (one line each)
    try:
        out = quiet_cost(20, 1)
    finally:
        logging.disable(logging.NOTSET)
    for kind in ("state_advert", "control_request", "release", "activation"):
        row = out[kind]
        assert row["on"] > 0 and row["off"] > 0, (kind, row)
        assert row["ratio_off_over_on"] == round(row["off"] / row["on"], 3)

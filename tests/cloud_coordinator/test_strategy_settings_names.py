"""RobustStrategy takes FedAvg's own keyword names as well as its settings records."""
from __future__ import annotations

import pytest

from cloud_coordinator import RobustStrategy
from cloud_coordinator.rounds import RoundConfig


def test_fedavg_keyword_names_fill_the_records() -> None:
    s = RobustStrategy(rule="median", f=0, fraction_evaluate=0.0, min_train_nodes=1, round_timeout=5.0, grace=0.0)
    assert (s.rounds.fraction_evaluate, s.rounds.min_train_nodes, s.rounds.round_timeout, s.rounds.grace) == (
        0.0, 1, 5.0, 0.0)


def test_a_name_given_directly_overrides_the_record() -> None:
    s = RobustStrategy(rounds=RoundConfig(min_train_nodes=4, round_timeout=9.0), min_train_nodes=3)
    assert (s.rounds.min_train_nodes, s.rounds.round_timeout) == (3, 9.0)


def test_an_unknown_name_is_one_line_with_the_closest() -> None:
    with pytest.raises(TypeError, match=r"'fraction_evalute' \(did you mean 'fraction_evaluate'\?\)"):
        RobustStrategy(fraction_evalute=0.0)

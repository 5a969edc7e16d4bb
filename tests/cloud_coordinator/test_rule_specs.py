"""Each aggregation rule's facts live once, in its spec beside its core (issue 31): the registry, the
quorum and the package's exports read them, so a new rule is one file (``aggregation/rules.py``)."""
from __future__ import annotations

import numpy as np
import pytest

import cloud_coordinator.aggregation as agg
from cloud_coordinator.aggregation import RULES, AggregationError, get_rule
from cloud_coordinator.aggregation.rules import SPECS


def test_the_registry_lists_exactly_the_specs() -> None:
    assert tuple(s.name for s in SPECS) == RULES


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_fact_of_a_rule_comes_from_its_spec(spec: agg.RuleSpec) -> None:
    assert getattr(agg, spec.function.__name__) is spec.function and spec.function.__name__ in agg.__all__
    for f in (0, 1, 2):
        assert get_rule(spec.name, f).min_clients == max(spec.min_clients(f), 1)
    with pytest.raises(AggregationError, match="unknown options"):
        get_rule(spec.name, 1, not_an_option=1)
    for option in spec.options:  # every option's check refuses a bad value at construction
        with pytest.raises(AggregationError, match=f"invalid value for option {option}"):
            get_rule(spec.name, 1, **{option: -1})
    # non-finite handling: a NaN client is rejected with its reason, the rest aggregate
    n = max(spec.min_clients(1), 3) + 1
    x = np.arange(n * 4, dtype=np.float64).reshape(n, 4) / 10
    x[-1, 0] = np.nan
    assert spec.nonfinite == "reject"
    res = get_rule(spec.name, 1).aggregate(x)
    assert res.rejected[n - 1] == "non-finite values" and np.isfinite(res.update).all()

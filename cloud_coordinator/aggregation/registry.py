"""Rule names -> configured, stateful aggregators (what the coordinator and CLI use).

A name is a ``+``-joined pipeline: optional pre-aggregators then one rule, e.g.
``bulyan``, ``nnm+trimmed_mean``, ``bucketing+centered_clipping``. An
``Aggregator`` owns the state a rule carries across rounds (centred clipping's
last aggregate, bucketing's random generator), and ``state_dict`` /
``load_state_dict`` capture all of it, so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from . import rules as _r
from ._errors import AggregationError
from ._kernels import mix
from ._result import AggregateResult, RuleSpec
from ._rows import RowStack
from ._validate import as_updates, guarded
from .clipping import clip_rows
from .distances import pairwise_sq_distances
from .preagg import PRE_OPTIONS, bucketing_matrix, groups_of, nnm_matrix

__all__ = [
    "RULES", "PREAGGREGATORS", "DEFAULT_RULE", "Aggregator", "get_rule", "robust_default",
    "describe", "quorum",
]

_RULES: dict[str, RuleSpec] = {spec.name: spec for spec in _r.SPECS}  # each rule's facts: rules.py
_PRE_KW = PRE_OPTIONS

RULES: tuple[str, ...] = tuple(_RULES)
PREAGGREGATORS: tuple[str, ...] = tuple(_PRE_KW)

# Chosen with `fogline bench robustness` (benchmarks/robustness_bench.py): over
# sign flip, IPM, ALIE, label flip, Gaussian and the adaptive ALIE / IPM that tune
# themselves against the rule, stateful centred clipping had the best worst case
# (Dirichlet 0.5, 3 seeds: 94.1 % vs 96.4 % clean FedAvg). NNM in front of it lost
# 5 points to adaptive IPM (the attacker hides inside every neighbourhood), and
# bucketing doubled the Byzantine share of the mixed rows.
DEFAULT_RULE = "centered_clipping"

NOT_SELECTED = "not selected"


def _parse(name: str) -> tuple[tuple[str, ...], str]:
    parts = tuple(p.strip() for p in name.split("+"))
    *pre, rule = parts
    if rule not in _RULES:
        raise AggregationError(f"unknown aggregation rule {rule!r}; choose from {', '.join(RULES)}")
    for p in pre:
        if p not in _PRE_KW:
            raise AggregationError(
                f"unknown pre-aggregator {p!r}; choose from {', '.join(PREAGGREGATORS)}")
    return tuple(pre), rule


def _check_options(name: str, rule: str, pre: tuple[str, ...], kw: dict[str, Any]) -> None:
    """Fail at construction, not in round 37, on a bad option value (each rule's and pre-aggregator's checks)."""
    checks = {**_RULES[rule].options, **{k: c for p in pre for k, c in _PRE_KW[p].items()}}
    for k, v in kw.items():
        if k in checks and not checks[k](v):
            raise AggregationError(f"{name}: invalid value for option {k}: {v!r}")


def quorum(rule_min: int, min_replies: int | None = None, min_nodes: int = 1) -> int:
    """Usable replies a round needs to count: the rule's minimum for its ``f`` (``Aggregator.min_clients``:
    2f+3 for Krum, 2f+1 for trimmed mean and median, ...), raised by the run's ``min_replies`` and
    ``min_nodes`` (a strategy's ``min_train_nodes``); never below the rule's minimum, never below 1."""
    return max(int(rule_min), int(min_replies or 0), int(min_nodes or 0), 1)


class Aggregator:
    """A configured pipeline with its cross-round state; one owner thread calls it."""

    __slots__ = ("_kw", "_pre", "_pre_kw", "_rng", "_rule", "_state", "f", "name", "rounds")

    def __init__(self, name: str, f: int, *, rng: np.random.Generator | None = None,
                 seed: int = 0, **kw: Any) -> None:
        pre, rule = _parse(name)
        allowed = set(_RULES[rule].options).union(*(_PRE_KW[p] for p in pre))
        unknown = set(kw) - allowed
        if unknown:
            raise AggregationError(f"{name}: unknown options {sorted(unknown)}")
        if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 0:
            raise AggregationError(f"{name}: f must be a non-negative integer, got {f!r}")
        self.name = name
        self.f = int(f)
        self._pre = pre
        self._rule = rule
        self._kw = {k: v for k, v in kw.items() if k in _RULES[rule].options}
        self._pre_kw = {k: v for k, v in kw.items() if k not in _RULES[rule].options}
        _check_options(name, rule, pre, kw)
        self._rng = rng if rng is not None else np.random.default_rng(seed)
        self._state: dict[str, Any] | None = None
        self.rounds = 0

    def __repr__(self) -> str:
        return f"Aggregator({self.name!r}, f={self.f})"

    @property
    def min_clients(self) -> int:
        """The fewest client rows this pipeline accepts for its ``f`` (the rule's bound)."""
        f = self.f
        need = _RULES[self._rule].min_clients(f)
        for p in reversed(self._pre):
            if p == "nnm":
                need = max(need, f + 1)
            elif p == "bucketing":  # ceil(n / s) rows must still satisfy what follows
                need = int(self._pre_kw.get("bucket_size", 2)) * (need - 1) + 1
        return max(need, 1)

    def aggregate(self, updates: np.ndarray | RowStack, weights: np.ndarray | None = None, *,
                  base: np.ndarray | None = None) -> AggregateResult:
        """Aggregate one round; non-finite client rows are rejected, not fatal.

        With ``base`` (the global weights, flat float64), ``updates`` are the clients'
        new weights rather than their differences: every rule and pre-aggregator except
        norm clipping commutes with a translation (Gram matrices are centred, medians
        and means shift along), so rules run on the weights as received and
        ``base`` is subtracted from the result. The update and the state stay
        in update space either way.
        """
        x = as_updates(updates)
        if base is not None:
            base = np.asarray(base, dtype=np.float64)
            if base.shape != (x.shape[1],):
                raise AggregationError(f"base must have shape ({x.shape[1]},), got {base.shape}")
            if "clip" in self._pre:  # norms are not translation-invariant: clip true differences
                x, base = (x.dense(base) if isinstance(x, RowStack) else
                           np.asarray(x, dtype=np.float64) - base), None
            elif isinstance(x, RowStack):
                x = cast(np.ndarray, x.centered_at(base))  # stands in for the array, as in as_updates
        res = guarded(lambda xx, ww: self._run(xx, ww, base), x, weights, _RULES[self._rule].nonfinite == "reject")
        if res.state is not None:
            self._state = dict(res.state)
        self.rounds += 1
        return res

    def _run(self, x: np.ndarray, w: np.ndarray | None, base: np.ndarray | None = None) -> AggregateResult:
        n = x.shape[0]
        groups: tuple[tuple[int, ...], ...] = tuple((i,) for i in range(n))
        for p in self._pre:
            if p == "clip":
                x, _ = clip_rows(x, self._pre_kw.get("clip_norm"))
                continue
            if p == "nnm":
                mat = nnm_matrix(pairwise_sq_distances(x), self.f)
            else:
                size = int(self._pre_kw.get("bucket_size", 2))
                mat = bucketing_matrix(x.shape[0], size, self._rng)
                if w is not None:
                    w = mat.astype(bool) @ w
            # Mixed rows are written as differences from ``base``: rows of ``mat`` sum to
            # one, so that is exact, and it keeps float32 rows precise.
            x = mix(x, mat, base)
            base = None
            groups = tuple(tuple(sorted({c for j in g for c in groups[j]})) for g in groups_of(mat))
        spec = _RULES[self._rule]
        kw = dict(self._kw)
        if spec.stateful:
            kw["state"] = self._state
            if base is not None:  # start from last round's aggregate, in the rows' (weight) space
                v = np.zeros(x.shape[1]) if self._state is None else np.asarray(self._state["v"])
                kw["state"] = {"v": v + base}
        res = spec.core(x, w, f=self.f, **kw)
        chosen = {c for i in res.selected for c in groups[i]}
        rejected = {i: NOT_SELECTED for i in range(n) if i not in chosen}
        update, state = res.update, res.state
        if base is not None:
            update = update - base
            state = None if state is None else {"v": np.asarray(state["v"]) - base}
        return AggregateResult(update, tuple(sorted(chosen)), rejected, state)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: rng state, rule state, round count (plain data)."""
        st = None
        if self._state is not None:
            st = {k: np.array(v, copy=True) for k, v in self._state.items()}
        return {
            "name": self.name, "f": self.f, "rounds": self.rounds,
            "rng": self._rng.bit_generator.state, "state": st,
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` captured; refuses a state from another pipeline."""
        if sd.get("name") != self.name or sd.get("f") != self.f:
            raise AggregationError(
                f"state is for {sd.get('name')!r} f={sd.get('f')}, not {self.name!r} f={self.f}")
        self._rng.bit_generator.state = dict(sd["rng"])
        st = sd.get("state")
        self._state = None if st is None else {k: np.array(v, copy=True) for k, v in st.items()}
        self.rounds = int(sd.get("rounds", 0))


def get_rule(name: str, f: int, **kw: Any) -> Aggregator:
    """Build the aggregator for ``name`` (e.g. ``"bulyan"``, ``"nnm+trimmed_mean"``)."""
    return Aggregator(name, f, **kw)


def robust_default(f: int, **kw: Any) -> Aggregator:
    """Fogline's default Byzantine-robust pipeline (``DEFAULT_RULE``)."""
    return Aggregator(DEFAULT_RULE, f, **kw)


def describe(name: str) -> str:
    """One line naming the pipeline's stages, for logs and the CLI."""
    pre, rule = _parse(name)
    return " -> ".join((*pre, rule))

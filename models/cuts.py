"""Valid cuts of a model's DAG and the chain profile the scheduler places.

A cut at position ``i`` splits the fixed topological order into the first ``i``
nodes and the rest; it carries every activation produced before and consumed
after (several tensors inside a residual block or across parallel branches;
graph inputs still needed later; graph outputs already produced). Weights and
constants never cross a cut: each partition keeps its own copy.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from models.errors import ModelError
from models.graph import GraphAnalysis, ModelSource, analyze
from models.profile import ModelProfile, cross_bytes, profile_model
from runtime.chain_profile import segment_dict

__all__ = [
    "ChainProfile",
    "Cut",
    "Segment",
    "chain_profile",
    "enumerate_cuts",
    "cut_points",
    "max_partitions",
    "resolve_cuts",
    "DEFAULT_SEGMENTS",
]

DEFAULT_SEGMENTS = 16


@dataclass(frozen=True, slots=True)
class Cut:
    """The boundary after the first ``index`` nodes and the tensors that cross it."""

    index: int
    tensors: tuple[str, ...]
    nbytes: int

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "tensors": list(self.tensors), "bytes": self.nbytes}


def _sweep(ga: GraphAnalysis) -> list[tuple[str, ...]]:
    """Tensor names crossing each position 0..n, in order of birth."""
    n = len(ga.nodes)
    born: list[list[str]] = [[] for _ in range(n + 1)]
    for name, b in ga.birth.items():
        end = ga.last_use.get(name)
        if end is not None and end > b:
            born[b + 1].append(name)
    live: dict[str, int] = {}
    out: list[tuple[str, ...]] = []
    for i in range(n + 1):
        for name in born[i]:
            live[name] = ga.last_use[name]
        if i > 0:
            for name in [t for t, end in live.items() if end < i]:
                del live[name]
        out.append(tuple(live))
    return out


def enumerate_cuts(src: ModelSource) -> list[Cut]:
    """Every cut of the model in its topological order: positions 1..len(nodes)-1."""
    ga = analyze(src)
    hit = ga.memo.get("cuts")
    if not isinstance(hit, tuple):
        sizes = cross_bytes(ga)
        names = _sweep(ga)
        hit = tuple(Cut(i, names[i], sizes[i]) for i in range(1, len(ga.nodes)))
        ga.memo["cuts"] = hit
    return list(hit)


def resolve_cuts(src: ModelSource, cuts: Sequence[int | Cut | Iterable[str]]) -> list[Cut]:
    """Validate a cut list (positions, Cut objects or tensor-name sets) into sorted Cuts.

    Raises ModelError naming the offending entry when it is out of range, repeated,
    out of order, or a tensor set that no cut of this model carries.
    """
    ga = analyze(src)
    n = len(ga.nodes)
    all_cuts = enumerate_cuts(ga)
    by_set: dict[frozenset[str], Cut] = {}
    for c in all_cuts:
        by_set.setdefault(frozenset(c.tensors), c)
    out: list[Cut] = []
    for spec in cuts:
        if isinstance(spec, bool):
            raise ModelError(f"cut {spec!r} is not a node position")
        if isinstance(spec, int):
            if not 1 <= spec <= n - 1:
                raise ModelError(
                    f"cut {spec} is out of range: valid cuts are 1..{n - 1} "
                    f"(the boundary after the first i of {n} nodes)"
                    if n > 1 else f"cut {spec}: a single-node model has no cuts"
                )
            cut = all_cuts[spec - 1]
        elif isinstance(spec, Cut):
            if not 1 <= spec.index <= n - 1 or all_cuts[spec.index - 1] != spec:
                raise ModelError(f"cut {spec.index} does not belong to this model")
            cut = spec
        else:
            names = frozenset(spec)
            unknown = sorted(t for t in names if t not in ga.tensors)
            if unknown:
                raise ModelError(f"cut names unknown tensor(s): {', '.join(unknown)}")
            if names not in by_set:
                raise ModelError(
                    f"tensors {{{', '.join(sorted(names))}}} are not a valid cut: "
                    f"they do not separate the graph into a head and a tail"
                )
            cut = by_set[names]
        if out and cut.index <= out[-1].index:
            raise ModelError(
                f"cut {cut.index} is not after cut {out[-1].index}: "
                f"cuts must be strictly increasing"
            )
        out.append(cut)
    return out


@dataclass(frozen=True, slots=True)
class Segment:
    """Nodes ``[start, end)`` of the topological order, with COST_MODEL.md figures."""

    name: str
    flops: int
    param_bytes: int
    activation_bytes: int  # peak live activations while the segment runs
    out_bytes: int  # bytes of the cut after it (the model output for the last)
    start: int
    end: int

    def to_dict(self) -> dict[str, object]:
        return segment_dict(self)


@dataclass(frozen=True, slots=True)
class ChainProfile:
    """The model as a chain of segments; ``cuts[i]`` lies between segments i and i+1."""

    model: str
    input_bytes: int
    segments: tuple[Segment, ...]
    cuts: tuple[Cut, ...]

    def to_dict(self, *, with_cuts: bool = False) -> dict[str, object]:
        """Exactly COST_MODEL.md's chain profile; ``with_cuts`` adds the cut tensors."""
        out: dict[str, object] = {
            "model": self.model,
            "input_bytes": self.input_bytes,
            "segments": [s.to_dict() for s in self.segments],
        }
        if with_cuts:
            out["cuts"] = [c.to_dict() for c in self.cuts]
        return out

    def node_range(self, first: int, last: int) -> tuple[int, int]:
        """Node positions ``[start, end)`` of the inclusive segment range ``[first, last]``."""
        k = len(self.segments)
        if not (0 <= first <= last < k):
            raise ModelError(
                f"segment range [{first}, {last}] is invalid: need 0 <= a <= b <= {k - 1}"
            )
        return self.segments[first].start, self.segments[last].end

    def matches(self, profile: Mapping[str, object]) -> bool:
        """True when a chain-profile dict describes the same segments as this one."""
        segs = profile.get("segments")
        return isinstance(segs, list) and [s.to_dict() for s in self.segments] == segs


def cut_points(src: ModelSource) -> list[int]:
    """Positions worth cutting at: right after a node with work, before another one.

    Nodes whose outputs are all constants (Constant, shape arithmetic on weights) do
    no work at run time and are copied into whichever partition reads them, so a
    cut next to them only makes an empty partition. Every segment between two of
    these points runs at least one node on activations.
    """
    ga = analyze(src)
    hit = ga.memo.get("points")
    if isinstance(hit, list):
        return hit
    work = [any(o and o not in ga.static for o in node.output) for node in ga.nodes]
    last = max((i for i, w in enumerate(work) if w), default=-1)
    points = [i for i in range(1, last + 1) if work[i - 1]]
    ga.memo["points"] = points
    return points


def max_partitions(src: ModelSource) -> int:
    """How many non-empty partitions the model can be split into at most."""
    return len(cut_points(src)) + 1


def _select(prof: ModelProfile, cross: list[int], k: int,
            strategy: Literal["cheapest", "balanced"], candidates: Sequence[int]) -> list[int]:
    n = len(prof.nodes)
    if strategy not in ("cheapest", "balanced"):
        raise ModelError(f"unknown segment strategy {strategy!r}: use 'cheapest' or 'balanced'")
    if k <= 1 or n <= 1 or not candidates:
        return []
    if k - 1 >= len(candidates):
        return list(candidates)
    cum = [0]
    for node in prof.nodes:
        cum.append(cum[-1] + node.flops)
    total = cum[-1] or 1
    frac = [c / total for c in cum]
    if strategy == "cheapest":
        # Fewest bytes first. Among cuts of equal size (every block boundary of a
        # residual stack), take the one farthest in FLOPs from those already kept,
        # so ties spread evenly instead of bunching (and never make empty segments).
        f = np.asarray(frac)
        nearest = np.clip(np.rint(f * k), 1, k - 1) / k
        off = np.abs(f - nearest)
        dist = np.minimum(f, 1.0 - f)
        levels: dict[int, list[int]] = {}
        for i in candidates:
            levels.setdefault(cross[i], []).append(i)
        picked: list[int] = []
        for size in sorted(levels):
            group = np.array(levels[size])
            while group.size and len(picked) < k - 1:
                # lexsort: last key is primary -> max dist, then min off, then min index
                best_pos = np.lexsort((group, off[group], -dist[group]))[0]
                best = int(group[best_pos])
                group = np.delete(group, best_pos)
                picked.append(best)
                np.minimum(dist, np.abs(f - f[best]), out=dist)
            if len(picked) >= k - 1:
                break
        return sorted(picked)
    chosen: set[int] = set()
    for t in (j / k for j in range(1, k)):
        window = [i for i in candidates if abs(frac[i] - t) <= 0.5 / k and i not in chosen]
        if window:
            chosen.add(min(window, key=lambda i: (cross[i], abs(frac[i] - t), i)))
    # Quantile windows are empty where one node holds most of the FLOPs (an If, a
    # big MatMul): fill up with the cut farthest from those kept, in FLOPs and
    # then in nodes, cheapest first, so k segments are asked and k are given.
    rest = [i for i in candidates if i not in chosen]
    while len(chosen) < k - 1 and rest:
        ends = [0, n, *chosen]
        best = min((-min(abs(frac[i] - frac[c]) for c in ends),
                    -min(abs(i - c) for c in ends) / n, cross[i], i) for i in rest)[-1]
        chosen.add(best)
        rest.remove(best)
    return sorted(chosen)


def chain_profile(src: ModelSource, max_segments: int = DEFAULT_SEGMENTS, *,
                  strategy: Literal["cheapest", "balanced"] = "cheapest",
                  cuts: Sequence[int | Cut | Iterable[str]] | None = None) -> ChainProfile:
    """Chain profile with at most ``max_segments`` segments (or exactly at ``cuts``).

    ``cheapest`` keeps the cuts carrying the fewest bytes (ties spread by FLOPs);
    ``balanced`` keeps, near each FLOP quantile, the cheapest cut.
    """
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
        raise ModelError(f"max_segments must be a positive integer, got {max_segments!r}")
    ga = analyze(src)
    prof = profile_model(ga)
    cross = cross_bytes(ga)
    all_cuts = enumerate_cuts(ga)
    if cuts is not None:
        points = [c.index for c in resolve_cuts(ga, cuts)]
    else:
        points = _select(prof, cross, max_segments, strategy, cut_points(ga))
    bounds = [0, *points, len(ga.nodes)]
    segments = []
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        nodes = prof.nodes[a:b]
        segments.append(Segment(
            name=f"s{s}",
            flops=sum(x.flops for x in nodes),
            param_bytes=sum(x.param_bytes for x in nodes),
            activation_bytes=max(x.live_bytes for x in nodes),
            out_bytes=cross[b],
            start=a,
            end=b,
        ))
    return ChainProfile(
        model=ga.name,
        input_bytes=cross[0],
        segments=tuple(segments),
        cuts=tuple(all_cuts[i - 1] for i in points),
    )

"""Cut enumeration against a brute-force definition; chain profiles; cut-list validation."""
from __future__ import annotations

import pytest

from models import zoo
from models.cuts import ChainProfile, chain_profile, enumerate_cuts, resolve_cuts
from models.errors import ModelError
from models.graph import analyze
from models.profile import profile_model

SMALL = [n for n in zoo.NAMES if n != "deep"]


def _brute_force(ga) -> dict[int, set[str]]:
    """Tensors produced before position i (or model inputs) and needed at or after it."""
    nodes = ga.nodes
    out = {}
    for i in range(1, len(nodes)):
        before = set(ga.inputs) | {o for n in nodes[:i] for o in n.output}
        after = {t for k in range(i, len(nodes)) for t in ga.node_inputs[k]} | set(ga.outputs)
        out[i] = {t for t in before & after if t not in ga.static}
    return out


@pytest.mark.parametrize("name", SMALL + ["deep-small"])
def test_cuts_match_definition(name: str) -> None:
    model = zoo.build("deep", blocks=4) if name == "deep-small" else zoo.build(name)
    ga = analyze(model)
    cuts = enumerate_cuts(ga)
    assert [c.index for c in cuts] == list(range(1, len(ga.nodes)))
    truth = _brute_force(ga)
    for c in cuts:
        assert set(c.tensors) == truth[c.index], c.index
        assert c.nbytes == sum(ga.tensors[t].nbytes for t in c.tensors)


@pytest.mark.parametrize(("name", "min_width"), [("resnet", 2), ("inception", 4),
                                                  ("transformer", 2), ("deep", 2)])
def test_multi_tensor_cuts_exist(name: str, min_width: int) -> None:
    assert max(len(c.tensors) for c in enumerate_cuts(zoo.build(name))) >= min_width


@pytest.mark.parametrize("name", zoo.NAMES)
@pytest.mark.parametrize("k", [1, 2, 4, 16, 10_000])
def test_chain_profile_shape(name: str, k: int) -> None:
    model = zoo.build(name)
    prof = profile_model(model)
    cp = chain_profile(model, k)
    n = len(prof.nodes)
    assert 1 <= len(cp.segments) <= min(k, n)
    assert len(cp.cuts) == len(cp.segments) - 1
    d = cp.to_dict()
    assert set(d) == {"model", "input_bytes", "segments"}
    assert all(set(s) == {"name", "flops", "param_bytes", "activation_bytes", "out_bytes"}
               for s in d["segments"])
    assert sum(s.flops for s in cp.segments) == prof.flops
    assert sum(s.param_bytes for s in cp.segments) == prof.param_bytes
    assert max(s.activation_bytes for s in cp.segments) == prof.peak_activation_bytes
    assert cp.input_bytes == prof.input_bytes
    assert cp.segments[-1].out_bytes == prof.output_bytes
    for seg, cut in zip(cp.segments, cp.cuts):
        assert seg.out_bytes == cut.nbytes and seg.end == cut.index
    assert cp.segments[0].start == 0 and cp.segments[-1].end == n
    assert all(a.end == b.start for a, b in zip(cp.segments, cp.segments[1:]))


def test_cheapest_keeps_the_smallest_cuts_and_spreads_ties() -> None:
    model = zoo.build("deep")
    cuts = enumerate_cuts(model)
    cp = chain_profile(model, 8)
    kept = sorted(c.nbytes for c in cp.cuts)
    assert kept == sorted(c.nbytes for c in cuts)[:7]
    fl = [s.flops for s in cp.segments]
    assert min(fl) > 0.5 * max(fl)  # equal-size block boundaries are spread evenly


def test_balanced_strategy_spreads_flops() -> None:
    model = zoo.build("resnet")
    cheap = chain_profile(model, 4)
    bal = chain_profile(model, 4, strategy="balanced")

    def spread(cp: ChainProfile) -> float:
        return max(s.flops for s in cp.segments) / sum(s.flops for s in cp.segments)

    assert spread(bal) < spread(cheap)
    with pytest.raises(ModelError, match="strategy"):
        chain_profile(model, 4, strategy="random")  # type: ignore[arg-type]


def test_explicit_cuts_and_node_range() -> None:
    model = zoo.build("resnet")
    cp = chain_profile(model, cuts=[5, 12])
    assert [s.start for s in cp.segments] == [0, 5, 12]
    assert cp.node_range(1, 2) == (5, len(analyze(model).nodes))
    with pytest.raises(ModelError, match="segment range"):
        cp.node_range(2, 3)
    with pytest.raises(ModelError, match="segment range"):
        cp.node_range(1, 0)


def test_to_dict_with_cuts() -> None:
    cp = chain_profile(zoo.build("inception"), 4)
    d = cp.to_dict(with_cuts=True)
    assert [c["index"] for c in d["cuts"]] == [c.index for c in cp.cuts]
    assert cp.matches(cp.to_dict()) and not cp.matches({"segments": []})


def test_resolve_cuts_accepts_positions_cuts_and_tensor_sets() -> None:
    model = zoo.build("resnet")
    cuts = enumerate_cuts(model)
    two = next(c for c in cuts if len(c.tensors) == 2)
    assert two.index > 2
    got = resolve_cuts(model, [1, cuts[1], set(two.tensors)])
    assert [c.index for c in got] == [1, 2, two.index]


@pytest.mark.parametrize(
    ("cuts", "match"),
    [
        ([0], "out of range"),
        ([31], "out of range"),
        ([-2], "out of range"),
        ([5, 5], "strictly increasing"),
        ([9, 4], "strictly increasing"),
        ([{"no_such_tensor"}], "unknown tensor"),
        ([{"x"}], "not a valid cut"),
        ([True], "not a node position"),
    ],
)
def test_resolve_cuts_rejects_bad_lists(cuts: list, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        resolve_cuts(zoo.build("resnet"), cuts)


def test_resolve_rejects_a_skip_without_its_partner() -> None:
    model = zoo.build("resnet")
    cuts = enumerate_cuts(model)
    # The block input and a tensor of the last stage never cross the same cut.
    with pytest.raises(ModelError, match="not a valid cut"):
        resolve_cuts(model, [{cuts[0].tensors[0], cuts[-1].tensors[0]}])


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_bad_segment_count(k: object) -> None:
    with pytest.raises(ModelError, match="max_segments"):
        chain_profile(zoo.build("mlp"), k)  # type: ignore[arg-type]

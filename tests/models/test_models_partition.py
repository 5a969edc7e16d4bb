"""Chaining partitions in onnxruntime reproduces the monolithic model; artifacts are honest."""
from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import zoo
from models.cuts import chain_profile, enumerate_cuts
from models.errors import ModelError
from models.partition import Partitioner, split, split_by_segments
from models.profile import profile_model

TOL = 1e-5
SMALL = [n for n in zoo.NAMES if n != "deep"]
_PARTITIONERS: dict[str, Partitioner] = {}
_REFERENCE: dict[str, tuple[dict, dict]] = {}


def _setup(name: str, bytes_runner, make_input) -> tuple[Partitioner, dict, dict]:
    if name not in _PARTITIONERS:
        model = zoo.build(name)
        p = Partitioner(model)
        feeds = make_input(p.ga, seed=1)
        _PARTITIONERS[name] = p
        _REFERENCE[name] = (feeds, bytes_runner(model.SerializeToString(), feeds))
    feeds, ref = _REFERENCE[name]
    return _PARTITIONERS[name], feeds, ref


def _check_chain(parts, feeds, ref, chain_runner) -> None:
    env = chain_runner(parts, feeds)
    for name, want in ref.items():
        assert np.abs(env[name] - want).max() <= TOL, name
    for a, b in itertools.pairwise(parts):
        assert a.output_names == b.input_names  # partitions chain by tensor name


@pytest.mark.parametrize("name", SMALL)
def test_every_cut_at_once(name: str, bytes_runner, make_input, chain_runner) -> None:
    p, feeds, ref = _setup(name, bytes_runner, make_input)
    parts = p.split(list(range(1, len(p.ga.nodes))))
    assert len(parts) == len(p.ga.nodes)
    _check_chain(parts, feeds, ref, chain_runner)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_default_chain_profile_partitions(name: str, bytes_runner, make_input,
                                          chain_runner) -> None:
    p, feeds, ref = _setup(name, bytes_runner, make_input)
    cp = chain_profile(p.ga)
    parts = split_by_segments(p.ga, cp, [(i, i) for i in range(len(cp.segments))])
    _check_chain(parts, feeds, ref, chain_runner)
    for part, seg in zip(parts, cp.segments):
        assert part.flops == seg.flops
        assert part.activation_bytes == seg.activation_bytes
        assert part.outputs[-1].nbytes <= seg.out_bytes
        assert sum(t.nbytes for t in part.outputs) == seg.out_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), name=st.sampled_from(zoo.NAMES))
def test_random_cut_sets(data, name: str, bytes_runner, make_input, chain_runner) -> None:
    p, feeds, ref = _setup(name, bytes_runner, make_input)
    n = len(p.ga.nodes)
    cuts = data.draw(st.lists(st.integers(1, n - 1), max_size=min(6, n - 1), unique=True)
                     .map(sorted))
    parts = p.split(cuts)
    assert len(parts) == len(cuts) + 1
    _check_chain(parts, feeds, ref, chain_runner)


@pytest.mark.parametrize("name", ["resnet", "inception"])
def test_multi_tensor_cuts_split_correctly(name: str, bytes_runner, make_input,
                                           chain_runner) -> None:
    p, feeds, ref = _setup(name, bytes_runner, make_input)
    wide = [c.index for c in enumerate_cuts(p.ga) if len(c.tensors) >= 2]
    parts = p.split(wide[::3])
    assert any(len(x.inputs) >= 2 for x in parts)
    _check_chain(parts, feeds, ref, chain_runner)


def test_artifact_fields() -> None:
    model = zoo.build("resnet")
    prof = profile_model(model)
    parts = split(model, [7, 20])
    assert sum(x.flops for x in parts) == prof.flops
    assert [x.nodes for x in parts] == [(0, 7), (7, 20), (20, 31)]
    for i, x in enumerate(parts):
        assert x.index == i and x.sha256 == hashlib.sha256(x.onnx_bytes).hexdigest()
        assert x.memory_bytes == x.param_bytes + x.activation_bytes
        m = x.manifest()
        json.dumps(m)
        assert m["sha256"] == x.sha256 and m["memory_bytes"] == x.memory_bytes
        assert {"name", "shape", "dtype"} == set(m["inputs"][0])
        assert x.signature is None and "signature" not in m
        loaded = x.load()
        assert [v.name for v in loaded.graph.input] == list(x.input_names)
    assert sum(x.param_bytes for x in parts) == prof.param_bytes
    assert parts[0].input_names == ("x",) and parts[-1].output_names == ("logits",)


def test_split_is_deterministic() -> None:
    a = split(zoo.build("inception"), [5, 17])
    b = split(zoo.build("inception"), [5, 17])
    assert [x.sha256 for x in a] == [x.sha256 for x in b]


def test_no_cuts_gives_the_whole_model(bytes_runner, make_input, chain_runner) -> None:
    p, feeds, ref = _setup("transformer", bytes_runner, make_input)
    parts = p.split([])
    assert len(parts) == 1
    _check_chain(parts, feeds, ref, chain_runner)


def test_split_by_segments_ranges_and_dicts(bytes_runner, make_input, chain_runner) -> None:
    p, feeds, ref = _setup("resnet", bytes_runner, make_input)
    cp = chain_profile(p.ga, 6, strategy="balanced")
    k = len(cp.segments)
    ranges = [(0, 1), (2, k - 2), (k - 1, k - 1)]
    parts = split_by_segments(p.ga, cp, ranges)
    _check_chain(parts, feeds, ref, chain_runner)
    assert [x.segments for x in parts] == ranges
    # The same from the JSON forms: with cut indices, and plain (default strategy).
    again = split_by_segments(p.ga, json.loads(json.dumps(cp.to_dict(with_cuts=True))), ranges)
    assert [x.sha256 for x in again] == [x.sha256 for x in parts]
    plain = chain_profile(p.ga, 6)
    from_dict = split_by_segments(p.ga, plain.to_dict(), [(0, len(plain.segments) - 1)])
    assert from_dict[0].nodes == (0, len(p.ga.nodes))
    # A subset of ranges: only the partition this device runs.
    only = split_by_segments(p.ga, cp, [(2, k - 2)])
    assert only[0].sha256 == parts[1].sha256


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ([(0, 1), (1, 2)], "overlaps"),
        ([(2, 3), (0, 1)], "overlaps"),
        ([(1, 0)], "segment range"),
        ([(0, 99)], "segment range"),
        ([("a", 1)], "pair of integers"),
    ],
)
def test_split_by_segments_rejects_bad_ranges(ranges, match: str) -> None:
    model = zoo.build("resnet")
    with pytest.raises(ModelError, match=match):
        split_by_segments(model, chain_profile(model, 4), ranges)


def test_split_by_segments_rejects_foreign_profiles() -> None:
    model = zoo.build("resnet")
    other = chain_profile(zoo.build("mlp"), 3)
    with pytest.raises(ModelError, match="does not match"):
        split_by_segments(model, other, [(0, 0)])
    with pytest.raises(ModelError, match="does not match"):
        split_by_segments(model, other.to_dict(), [(0, 0)])
    with pytest.raises(ModelError, match="segments"):
        split_by_segments(model, {"model": "x"}, [(0, 0)])


def test_signed_partitions_verify() -> None:
    security = pytest.importorskip("runtime.security")
    from runtime.errors import RemoteViolation

    ident = security.Identity.generate("fog-broker-test")
    parts = split(zoo.build("mlp"), [1], signer=ident)
    for x in parts:
        assert x.signature is not None
        security.verify_artifact(ident.public_key_bytes, x.onnx_bytes, x.signature)
        m = x.manifest()
        restored = security.ArtifactSignature.from_dict(json.loads(json.dumps(m["signature"])))
        security.verify_artifact(ident.public_key_bytes, x.onnx_bytes, restored)
        with pytest.raises(RemoteViolation):
            security.verify_artifact(ident.public_key_bytes, x.onnx_bytes + b"\0", x.signature)


def _two_io_model():
    """Two inputs (one only read at the end) and two outputs (one produced early)."""
    from onnx import TensorProto, helper

    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3])  # noqa: E731
    nodes = [
        helper.make_node("Relu", ["x"], ["early"]),
        helper.make_node("Neg", ["early"], ["h1"]),
        helper.make_node("Exp", ["h1"], ["h2"]),
        helper.make_node("Add", ["h2", "late"], ["final"]),
    ]
    g = helper.make_graph(nodes, "two_io", [vi("x"), vi("late")], [vi("early"), vi("final")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cuts", [[1], [2], [3], [1, 2, 3], [1, 3]])
def test_early_outputs_and_late_inputs_are_carried(cuts, bytes_runner, chain_runner) -> None:
    model = _two_io_model()
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=(2, 3)).astype(np.float32) for n in ("x", "late")}
    ref = bytes_runner(model.SerializeToString(), feeds)
    parts = split(model, cuts)
    env = chain_runner(parts, feeds)
    for k in ("early", "final"):
        assert np.abs(env[k] - ref[k]).max() <= TOL
    assert set(parts[-1].output_names) == {"early", "final"}
    assert all("late" in p.input_names for p in parts)  # forwarded until it is read

"""External data names files only next to a model file on the user's own disk (issue 20, finding 2).

Model bytes or a proto have no directory of their own: before, their side-file locations
were resolved against the working directory, so splitting or sizing such a model put any
file the process could read inside a partition. Now they are refused in one line; a model
file's side files must be regular files inside its directory, reached without a symlink.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models.errors import ModelError
from models.external import external_location_error, external_tensors
from models.graph_files import resolve_external
from models.partition import Partitioner
from models.probe import analyze, run_shapes

SECRET = b"TOP-SECRET-SITE-CA-KEY-BYTES-000"  # 32 bytes


def _external(t: TensorProto, location: str, n: int) -> TensorProto:
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(n))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def adder(location: str, n: int = len(SECRET)) -> onnx.ModelProto:
    """``y = x + W`` over uint8[n], ``W`` in a side file: zeros in, the side file's bytes out."""
    w = _external(TensorProto(name="W", data_type=TensorProto.UINT8, dims=[n]), location, n)
    g = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "adder",
                          [helper.make_tensor_value_info("x", TensorProto.UINT8, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.UINT8, [n])], initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A secret file in the working directory, as the fog's key files are relative to ``/``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.key").write_bytes(SECRET)
    return tmp_path


@pytest.mark.parametrize("location,ok", [
    ("w.bin", True), ("weights/w.bin", True), ("./w.bin", True),
    ("", False), ("/etc/passwd", False), ("\\\\host\\share\\w", False), ("C:\\keys\\ca.key", False),
    ("..", False), ("../ca.key", False), ("sub/../../ca.key", False), ("sub\\..\\..\\ca.key", False),
    ("w\x00.bin", False),
])
def test_location_rules_are_one_pure_function(location: str, ok: bool) -> None:
    assert (external_location_error(location) == "") is ok


def test_every_external_tensor_is_found() -> None:
    """Initializers, a Constant's value, a subgraph's initializer, a sparse initializer, a function."""
    m = adder("a.bin")
    const = _external(TensorProto(name="C", data_type=TensorProto.UINT8, dims=[1]), "c.bin", 1)
    m.graph.node.append(helper.make_node("Constant", [], ["k"], value=const))
    sub = helper.make_graph([helper.make_node("Identity", ["S"], ["o"])], "then", [],
                            [helper.make_tensor_value_info("o", TensorProto.UINT8, [1])],
                            initializer=[_external(TensorProto(name="S", data_type=TensorProto.UINT8,
                                                               dims=[1]), "s.bin", 1)])
    m.graph.node.append(helper.make_node("If", ["cond"], ["r"], then_branch=sub, else_branch=sub))
    sp = m.graph.sparse_initializer.add()
    sp.values.CopyFrom(_external(TensorProto(name="SP", data_type=TensorProto.UINT8, dims=[1]),
                                 "sp.bin", 1))
    fn = helper.make_function("acme", "F", ["a"], ["b"], [helper.make_node(
        "Constant", [], ["b"], value=_external(TensorProto(name="FC", data_type=TensorProto.UINT8,
                                                           dims=[1]), "f.bin", 1))],
        [helper.make_opsetid("", 17)])
    m.functions.append(fn)
    found = {(e.name, e.location, e.initializer) for e in external_tensors(m)}
    assert found == {("W", "a.bin", True), ("C", "c.bin", False), ("S", "s.bin", False),
                     ("S", "s.bin", False), ("SP", "sp.bin", False), ("FC", "f.bin", False)}


@pytest.mark.parametrize("as_bytes", [True, False])
def test_a_model_given_as_bytes_cannot_read_the_working_directory(in_cwd: Path, as_bytes: bool) -> None:
    m = adder("secret.key")
    src = m.SerializeToString() if as_bytes else m
    with pytest.raises(ModelError) as info:
        parts = Partitioner(analyze(src)).split([])
        assert SECRET not in parts[0].onnx_bytes  # what it did before: the file, inline
    msg = str(info.value)
    assert "\n" not in msg and "external data" in msg and "secret.key" not in msg, msg


def test_the_sizing_run_never_reads_the_working_directory(in_cwd: Path) -> None:
    """A model sized by one onnxruntime run (as bytes, no directory): side files resolve nowhere."""
    m = adder("secret.key")
    with pytest.raises(ModelError):
        got = run_shapes(m, {"x": np.zeros(len(SECRET), np.uint8)}, ["y"])
        assert got["y"] != ((len(SECRET),), "uint8", len(SECRET)), "onnxruntime read the secret"


def test_an_analysis_without_a_directory_never_loads_weights(in_cwd: Path) -> None:
    """Belt and braces: even a hand-made analysis with no directory does not resolve locations."""
    (in_cwd / "m").mkdir()
    onnx.save_model(adder("w.bin"), str(in_cwd / "m" / "m.onnx"))
    (in_cwd / "m" / "w.bin").write_bytes(bytes(len(SECRET)))
    ga = analyze(in_cwd / "m" / "m.onnx")
    assert ga.external_dir
    with pytest.raises(ModelError, match="external data"):
        Partitioner(dataclasses.replace(ga, external_dir="")).split([])


def _model_dir(tmp_path: Path, location: str) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    path = d / "m.onnx"
    onnx.save_model(adder(location), str(path))
    return path


def test_side_files_of_a_model_file_stay_in_its_directory(tmp_path: Path) -> None:
    (tmp_path / "secret.key").write_bytes(SECRET)
    path = _model_dir(tmp_path, "w.bin")
    (path.parent / "w.bin").write_bytes(bytes(range(len(SECRET))))
    part = Partitioner(analyze(path)).split([])[0]  # the legitimate case: a file next to it
    assert bytes(range(len(SECRET))) in part.onnx_bytes
    # a symlink next to the model, to a file outside its directory
    (path.parent / "link.bin").symlink_to(tmp_path / "secret.key")
    # a directory symlink on the way
    (path.parent / "up").symlink_to(tmp_path)
    for location in ["link.bin", "up/secret.key", "../secret.key", str(tmp_path / "secret.key")]:
        bad = _model_dir(tmp_path, location)
        with pytest.raises(ModelError) as info:
            Partitioner(analyze(bad)).split([])
        assert "\n" not in str(info.value), location


def test_resolve_external_refuses_a_symlink_inside_the_directory_too(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"x")
    (tmp_path / "alias.bin").symlink_to(tmp_path / "w.bin")
    assert resolve_external(tmp_path, "w.bin") == (tmp_path / "w.bin").resolve()
    for location in ["alias.bin", "missing.bin", "/etc/passwd", "../w.bin"]:
        with pytest.raises(ModelError) as info:
            resolve_external(tmp_path, location, "W", "m.onnx")
        assert str(info.value).startswith("m.onnx: weight 'W'"), str(info.value)

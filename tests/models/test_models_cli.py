"""``fogline models ...`` end to end through argparse: files, JSON, exit codes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest


def _run(argv: list[str]) -> int:
    from runtime.cli import main  # the whole command: bad arguments are one "error:" line, exit 2

    return main(argv)


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoo")
    assert _run(["models", "zoo", "--out", str(out), "--names", "mlp,resnet,inception"]) == 0
    return out


def test_zoo_writes_files(zoo_dir: Path) -> None:
    assert sorted(p.name for p in zoo_dir.glob("*.onnx")) == [
        "inception.onnx", "mlp.onnx", "resnet.onnx"]


def test_profile_json_is_the_chain_profile(zoo_dir: Path, capsys) -> None:
    assert _run(["models", "profile", str(zoo_dir / "resnet.onnx"), "--segments", "5",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"model", "input_bytes", "segments"} and len(d["segments"]) <= 5


def test_profile_table(zoo_dir: Path, capsys) -> None:
    assert _run(["models", "profile", str(zoo_dir / "mlp.onnx")]) == 0
    out = capsys.readouterr().out
    assert "Gemm" in out and "total:" in out and '"segments"' in out


@pytest.mark.parametrize("how", [["--cuts", "5,17"], ["--partitions", "3"]])
def test_split_writes_chainable_parts(zoo_dir: Path, tmp_path: Path, how: list[str],
                                      bytes_runner) -> None:
    out = tmp_path / "parts"
    assert _run(["models", "split", str(zoo_dir / "inception.onnx"), *how,
                 "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    parts = manifest["partitions"]
    assert [p["file"] for p in parts] == [f"part-{i}.onnx" for i in range(len(parts))]
    feeds = {"x": np.random.default_rng(0).normal(size=(1, 3, 32, 32)).astype(np.float32)}
    ref = bytes_runner((zoo_dir / "inception.onnx").read_bytes(), feeds)["logits"]
    env = dict(feeds)
    for p in parts:
        data = (out / p["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == p["sha256"]
        assert {"inputs", "outputs", "flops", "memory_bytes"} <= set(p)
        env.update(bytes_runner(data, env))
    assert np.abs(env["logits"] - ref).max() <= 1e-5


def test_split_signed(zoo_dir: Path, tmp_path: Path) -> None:
    security = pytest.importorskip("runtime.security")
    out = tmp_path / "signed"
    assert _run(["models", "split", str(zoo_dir / "mlp.onnx"), "--cuts", "1", "--out", str(out),
                 "--sign-as", "tester"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    key = bytes.fromhex(manifest["signer_public_key"])
    for p in manifest["partitions"]:
        sig = security.ArtifactSignature.from_dict(p["signature"])
        security.verify_artifact(key, (out / p["file"]).read_bytes(), sig)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["profile", "{dir}/missing.onnx"], "no such file"),
        (["profile", "{dir}/trunc.onnx"], "truncated or corrupt"),
        (["profile", "{zoo}/mlp.onnx", "--segments", "0"], "--segments"),
        (["profile", "{zoo}/mlp.onnx", "--dim", "N"], "NAME=INT"),
        (["split", "{zoo}/mlp.onnx", "--cuts", "9", "--out", "{dir}/o"], "out of range"),
        (["split", "{zoo}/mlp.onnx", "--cuts", "2,1", "--out", "{dir}/o"], "strictly increasing"),
        (["split", "{zoo}/mlp.onnx", "--cuts", "x", "--out", "{dir}/o"], "--cuts expects"),
        (["split", "{zoo}/mlp.onnx", "--partitions", "0", "--out", "{dir}/o"], "--partitions"),
        (["zoo", "--out", "{dir}/z", "--names", "alexnet"], "unknown zoo model"),
    ],
)
def test_bad_input_exits_2(zoo_dir: Path, tmp_path: Path, capsys, argv: list[str],
                           match: str) -> None:
    (tmp_path / "trunc.onnx").write_bytes((zoo_dir / "resnet.onnx").read_bytes()[:500])
    argv = [a.format(dir=tmp_path, zoo=zoo_dir) for a in argv]
    assert _run(["models", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0]


def test_dynamic_model_via_cli(tmp_path: Path, capsys) -> None:
    from models.train import MLP, to_onnx

    path = tmp_path / "dyn.onnx"
    path.write_bytes(to_onnx(MLP().get_weights()).SerializeToString())
    assert _run(["models", "profile", str(path), "--json"]) == 2
    assert "dynamic shape" in capsys.readouterr().err
    assert _run(["models", "profile", str(path), "--json", "--dim", "N=4"]) == 0


def test_fogline_entry_point(zoo_dir: Path, capsys) -> None:
    runtime_cli = pytest.importorskip("runtime.cli")
    assert runtime_cli.main(["models", "profile", str(zoo_dir / "mlp.onnx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "mlp"


def _anonymous_model(path: Path) -> Path:
    """Input [N, 3, ?, ?]: one named and two anonymous dims (as PP-OCR's models have)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, None, None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, None, None])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]),
                           helper.make_node("Sigmoid", ["h"], ["s"]),
                           helper.make_node("Neg", ["s"], ["y"])], "anon", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(m.SerializeToString())
    return path


@pytest.mark.parametrize("flag", [["--input-shape", "x=1,3,8,16"], ["--input-shape", "x=1x3x8x16"]])
def test_input_shape_flag(tmp_path: Path, capsys, flag: list[str], bytes_runner) -> None:
    model = _anonymous_model(tmp_path / "anon.onnx")
    assert _run(["models", "profile", str(model), "--json", *flag]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["input_bytes"] == 1 * 3 * 8 * 16 * 4
    out = tmp_path / "parts"
    assert _run(["models", "split", str(model), *flag, "--partitions", "3", "--out", str(out)]) == 0
    parts = json.loads((out / "manifest.json").read_text())["partitions"]
    assert len(parts) == 3 and parts[1]["inputs"][0]["shape"] == [1, 3, 8, 16]
    feeds = {"x": np.random.default_rng(0).normal(size=(1, 3, 8, 16)).astype(np.float32)}
    env = dict(feeds)
    for p in parts:
        env.update(bytes_runner((out / p["file"]).read_bytes(), env))
    assert np.abs(env["y"] - bytes_runner(model.read_bytes(), feeds)["y"]).max() <= 1e-6


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["profile", "{anon}", "--dim", "N=1"], "tensor 'x' (graph input) has dimension '?'"),
        (["profile", "{anon}"], "--input-shape x="),
        (["profile", "{anon}", "--input-shape", "x=1,3,8"], "does not match the model"),
        (["profile", "{anon}", "--input-shape", "x=1,4,8,8"], "fixed at 3"),
        (["profile", "{anon}", "--input-shape", "z=1,3,8,8"], "no input 'z'"),
        (["profile", "{anon}", "--input-shape", "x=1,3,a,8"], "--input-shape expects"),
        (["profile", "{anon}", "--input-shape", "1,3,8,8"], "--input-shape expects"),
        (["profile", "{anon}", "--input-shape", "x=1,3,8,8", "--input-shape", "x=1,3,8,8"],
         "given twice"),
        (["profile", "{anon}", "--input-shape", "x=1,3,8,8", "--input-value", "x"],
         "--input-value expects"),
        (["split", "{anon}", "--input-shape", "x=1,3,8,8", "--partitions", "4", "--out",
          "{dir}/o"], "cannot split into 4 partitions"),
        (["split", "{dir}/trunc.onnx", "--input-shape", "x=1,3,8,8", "--partitions", "2",
          "--out", "{dir}/o"], "truncated or corrupt"),
    ],
)
def test_shape_errors_exit_2(tmp_path: Path, capsys, argv: list[str], match: str) -> None:
    anon = _anonymous_model(tmp_path / "anon.onnx")
    (tmp_path / "trunc.onnx").write_bytes(anon.read_bytes()[:60])
    argv = [a.format(dir=tmp_path, anon=anon) for a in argv]
    assert _run(["models", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err

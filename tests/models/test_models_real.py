"""Real third-party ONNX files: profile, split 2/3/4 ways, chain in onnxruntime, same outputs.

The models are the ``.onnx`` files inside the wheels of rapidocr-onnxruntime (PP-OCR
detector, recogniser, direction classifier), nudenet (YOLOv8n) and silero-vad (six
variants, with If, LSTM and state inputs/outputs), fetched with ``pip download`` by
``conftest.wheel_model``, plus the ``onnx`` wheel's own model-zoo test data.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from models.cuts import chain_profile
from models.errors import ProfileWarning
from models.partition import Partitioner
from models.probe import analyze, feeds_for, rel_diff
from models.profile import profile_model
from models.thirdparty import MODELS, ONNX_TEST_MODELS

from chain_helpers import split_and_compare

pytestmark = pytest.mark.integration

TOL = 1e-5
RAPIDOCR = "rapidocr-onnxruntime"
SILERO = "silero-vad"
HEAVY = {"light_vgg19"}  # 20 GFLOPs a run, 550 MB of weights made at run time


def _params() -> list[object]:
    out = []
    for m in MODELS:
        out.append(pytest.param(("wheel", (m.package, m.member)), m.input_shapes, m.input_values,
                                m.nodes, id=m.id))
    for name, nodes in ONNX_TEST_MODELS:
        marks = [pytest.mark.slow] if name in HEAVY else []
        out.append(pytest.param(("onnx", name), {}, {}, nodes, id=name.removeprefix("light_"),
                                marks=marks))
    return out


def _path(where: tuple[str, object], third_party, onnx_test_data) -> Path:
    kind, what = where
    if kind == "wheel":
        package, member = what  # type: ignore[misc]
        return third_party(package, member)
    path = onnx_test_data(str(what))
    if path is None:
        pytest.skip(f"the installed onnx wheel ships no test model {what}")
    return path


def _feeds(ga, values: dict[str, object]) -> dict[str, np.ndarray]:
    return feeds_for(ga, values, seed=7)  # not the probe's seed: outputs checked on new data


@pytest.mark.parametrize(("where", "shapes", "values", "nodes"), _params())
def test_profile_split_and_chain(where, shapes, values, nodes, third_party, onnx_test_data,
                                 bytes_runner, chain_runner) -> None:
    path = _path(where, third_party, onnx_test_data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)  # If/LSTM etc. have no FLOP rule
        ga = analyze(path, input_shapes=shapes, input_values=values)
        p = Partitioner(ga)
        prof = profile_model(ga)
    assert len(ga.nodes) == nodes
    assert prof.flops >= 0 and prof.peak_activation_bytes > 0
    json.dumps(chain_profile(ga, 16, strategy="balanced").to_dict())
    feeds = _feeds(ga, values)
    ref = bytes_runner(path.read_bytes(), feeds)
    for name in ga.outputs:  # the sizes the profile charges are the sizes of a real run
        assert ga.tensors[name].shape == ref[name].shape, name
    split_and_compare(p, feeds, ref, TOL)


def _cli(argv: list[str]) -> int:
    import argparse

    from models import cli

    parser = argparse.ArgumentParser(prog="fogline")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_on_the_recogniser(tmp_path: Path, capsys, third_party, bytes_runner) -> None:
    """The issue's first failure: an anonymous height dim, now given with --input-shape."""
    rec = third_party(RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx")
    assert _cli(["models", "profile", str(rec), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'x'" in err[0] and "--input-shape x=" in err[0], err
    out = tmp_path / "parts"
    assert _cli(["models", "split", str(rec), "--input-shape", "x=1,3,48,160", "--partitions",
                 "3", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 3, 48, 160)).astype(np.float32)}
    ref = bytes_runner(rec.read_bytes(), feeds)
    env = dict(feeds)
    for part in manifest["partitions"]:
        env.update(bytes_runner((out / part["file"]).read_bytes(), env))
    assert max(rel_diff(env[k], v) for k, v in ref.items()) <= TOL


def test_silero_needs_its_sample_rate(capsys, third_party) -> None:
    """Zeros for 'sr' take the 8 kHz branch, which 512-sample chunks cannot run: say so."""
    vad = third_party(SILERO, "silero_vad/data/silero_vad.onnx")
    shapes = ["--input-shape", "input=1,512", "--input-shape", "state=2,1,128"]
    assert _cli(["models", "profile", str(vad), "--json", *shapes]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--input-value sr=" in err[0], err
    assert _cli(["models", "profile", str(vad), "--json", *shapes,
                 "--input-value", "sr=16000"]) == 0

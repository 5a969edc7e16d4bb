"""What ``fogline infer`` reads (``fog_broker.infer_inputs``), and its one-line errors for the rest."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fog_broker.infer_inputs import InputError, load_inputs, parse_inputs
from runtime.cli import main

NCHW = [{"name": "x", "datatype": "FP32", "shape": [1, 3, 32, 32]}]


def _npy(arr: Any, **kw: Any) -> bytes:
    b = io.BytesIO()
    np.save(b, arr, **kw)
    return b.getvalue()


def _npz(**arrays: Any) -> bytes:
    b = io.BytesIO()
    np.savez(b, **arrays)
    return b.getvalue()


def _png(w: int = 40, h: int = 24, mode: str = "RGB") -> bytes:
    from PIL import Image
    rng = np.random.default_rng(0)
    shape = (h, w, 3) if mode == "RGB" else (h, w)
    b = io.BytesIO()
    Image.fromarray((rng.random(shape) * 255).astype(np.uint8), mode).save(b, "PNG")
    return b.getvalue()


def test_npy_npz_and_json() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert parse_inputs("a.npy", _npy(x))["x"].tolist() == x.tolist()
    assert list(parse_inputs("a.npy", _npy(x), input_name="input_1")) == ["input_1"]
    assert list(parse_inputs("a.npy", _npy(x), inputs=[{"name": "pixels", "dtype": "float32", "shape": [2, 3]}])) \
        == ["pixels"]
    got = parse_inputs("b.npz", _npz(a=x, b=np.ones(2, np.int64)))
    assert set(got) == {"a", "b"} and got["b"].dtype == np.int64
    doc = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": x.tolist()}], "id": "ignored"}
    np.testing.assert_array_equal(parse_inputs("t.json", json.dumps(doc).encode())["x"], x)
    # sniffed by content when the suffix says nothing
    assert "x" in parse_inputs("tensor.bin", _npy(x)) and "a" in parse_inputs("tensors", _npz(a=x))


def test_images_resized_laid_out_and_scaled() -> None:
    pytest.importorskip("PIL")
    got = parse_inputs("cat.png", _png(), inputs=NCHW)["x"]
    assert got.shape == (1, 3, 32, 32) and got.dtype == np.float32 and got.min() >= 0 and got.max() <= 1
    nhwc = parse_inputs("cat.jpg.png", _png(), inputs=[{"name": "img", "dtype": "uint8", "shape": [1, 28, 28, 3]}])
    assert nhwc["img"].shape == (1, 28, 28, 3) and nhwc["img"].dtype == np.uint8 and nhwc["img"].max() > 1
    gray = parse_inputs("digit", _png(mode="L"), inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 1, 8, 8]}])
    assert gray["x"].shape == (1, 1, 8, 8)
    keep = parse_inputs("any.png", _png(20, 10), inputs=[{"name": "x", "datatype": "FP32", "shape": [3, -1, -1]}])
    assert keep["x"].shape == (3, 10, 20)


@pytest.mark.parametrize("name, data, inputs, words", [
    ("obj.npy", _npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), None, "not a usable .npy"),
    ("str.npy", _npy(np.array(["a", "b"])), None, "is not numeric"),
    ("broken.npy", b"\x93NUMPY garbage", None, "not a usable .npy"),
    ("obj.npz", _npz(a=np.array([None], dtype=object)), None, "not a usable .npz"),
    ("bad.json", b"{\"inputs\": [1, 2", None, "not valid JSON"),
    ("bad.json", b"{\"x\": [1, 2]}", None, "{\"inputs\": ["),
    ("bad.json", b"{\"inputs\": [{\"name\": \"x\", \"shape\": [2], \"datatype\": \"FP32\", \"data\": [1]}]}",
     None, "needs 2"),
    ("notes.txt", b"hello world", None, "not a format fogline infer reads"),
    ("cat.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 20, NCHW, "not a readable image"),
    ("cat.png", b"\x89PNG\r\n\x1a\n", None, "needs the model's input shape"),
    ("cat.png", b"\x89PNG\r\n\x1a\n", [{"name": "x", "dtype": "float32", "shape": [1, 64]}], "no image input"),
    ("cat.png", b"\x89PNG\r\n\x1a\n", [{"name": "x", "dtype": "float32", "shape": [1, 5, 8, 8]}], "1 or 3 channels"),
    ("cat.png", b"\x89PNG\r\n\x1a\n", [{"name": "x", "dtype": "float32", "shape": [4, 3, 8, 8]}], "batch of 4"),
    ("cat.png", b"\x89PNG\r\n\x1a\n", [{"name": "x", "dtype": "int64", "shape": [1, 3, 8, 8]}], "float or uint8"),
])
def test_unusable_inputs_are_one_line_errors(name: str, data: bytes, inputs: Any, words: str) -> None:
    with pytest.raises(InputError) as e:
        parse_inputs(name, data, inputs=inputs)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith(name), msg


def test_images_without_pillow_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL -> ImportError
    with pytest.raises(InputError, match="needs Pillow"):
        parse_inputs("cat.png", b"\x89PNG\r\n\x1a\n", inputs=NCHW)


def test_zoo_model_inputs_for_images_without_the_http_api() -> None:
    from fog_broker.infer_inputs import zoo_inputs
    assert zoo_inputs("zoo:resnet") == [{"name": "x", "dtype": "float32", "shape": [1, 3, 32, 32]}]
    assert zoo_inputs("file:" + "0" * 64) is None and zoo_inputs("zoo:no-such-model") is None


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_inputs(tmp_path / "nope.npy")


@pytest.mark.parametrize("name, data", [
    ("bad.json", b"{not json"),
    ("pickled.npy", _npy(np.array([object()], dtype=object), allow_pickle=True)),
    ("notes.txt", b"plain text"),
])
def test_cli_infer_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   name: str, data: bytes) -> None:
    (tmp_path / name).write_bytes(data)
    rc = main(["infer", "w", str(tmp_path / name), "--credentials", str(tmp_path / "no-creds")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err

"""What ``fogline infer`` reads: ``.npy``, ``.npz``, the Open Inference Protocol's JSON tensors, or an image.

``parse_inputs`` is pure (bytes in, named arrays out); ``load_inputs`` reads the
file. Every problem is one ``InputError`` line naming the file and what to do,
never a traceback: a pickled ``.npy`` is refused (``allow_pickle=False``), JSON
must be ``{"inputs": [{"name", "shape", "datatype", "data"}, ...]}`` (a whole
inference request is fine too), and an image needs Pillow and the model's
input description (``{"name", "datatype" or numpy "dtype", "shape"}`` rows) to
be resized to the input's height and width, laid out NCHW or NHWC as the shape
says (1 or 3 channels), and scaled to [0, 1] for float inputs (0..255 kept for
UINT8 inputs).
"""
from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import LocalViolation

from . import oip

__all__ = ["InputError", "load_inputs", "parse_inputs", "is_image", "IMAGE_SUFFIXES", "zoo_inputs"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*",
                b"P5", b"P6")
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
_FORMATS = ".npy, .npz, JSON ({\"inputs\": [{\"name\", \"shape\", \"datatype\", \"data\"}]}) or an image"


class InputError(LocalViolation):
    """An input file ``fogline infer`` cannot use (one line)."""


def is_image(filename: str, head: bytes = b"") -> bool:
    """By suffix, or by magic bytes when the suffix says nothing."""
    if Path(filename).suffix.lower() in IMAGE_SUFFIXES:
        return True
    return head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _kind(filename: str, data: bytes) -> str:
    suffix = Path(filename).suffix.lower()
    if suffix == ".npy" or data.startswith(_NPY_MAGIC):
        return "npy"
    if suffix == ".npz" or data.startswith(_ZIP_MAGIC):
        return "npz"
    if suffix == ".json" or data.lstrip()[:1] == b"{":
        return "json"
    if is_image(filename, data[:16]):
        return "image"
    return ""


def parse_inputs(filename: str, data: bytes, *, input_name: str | None = None,
                 inputs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """Named input tensors from the bytes of ``filename``; ``inputs`` describes the model's inputs
    (needed for images; otherwise it only names a lone ``.npy`` tensor when ``input_name`` does not)."""
    kind = _kind(filename, data)
    default_name = input_name or (str(inputs[0]["name"]) if inputs else "x")
    if kind == "npy":
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"{filename}: not a usable .npy array ({_first_line(exc)}); "
                             "save plain numeric arrays with numpy.save") from None
        return {default_name: _numeric(arr, filename, default_name)}
    if kind == "npz":
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                out = {k: _numeric(z[k], filename, k) for k in z.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise InputError(f"{filename}: not a usable .npz archive ({_first_line(exc)}); "
                             "save named numeric arrays with numpy.savez") from None
        if not out:
            raise InputError(f"{filename}: the .npz archive holds no arrays")
        return out
    if kind == "json":
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"{filename}: not valid JSON ({_first_line(exc)})") from None
        except RecursionError:
            raise InputError(f"{filename}: not valid JSON (nested too deeply)") from None
        if not isinstance(doc, dict) or "inputs" not in doc:
            raise InputError(f"{filename}: JSON inputs must be {{\"inputs\": [{{\"name\", \"shape\", "
                             "\"datatype\", \"data\"}, ...]} (the Open Inference Protocol's tensors)")
        try:
            return oip.parse_tensors(doc["inputs"])
        except oip.ProtocolError as exc:
            raise InputError(f"{filename}: {exc.message}") from None
    if kind == "image":
        return image_inputs(filename, data, inputs, input_name)
    raise InputError(f"{filename}: not a format fogline infer reads; give {_FORMATS}")


def load_inputs(path: str | Path, *, input_name: str | None = None,
                inputs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """``parse_inputs`` of a file; unreadable files are one ``InputError`` line too."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {p}: {exc.strerror or exc}") from None
    return parse_inputs(str(p), data, input_name=input_name, inputs=inputs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _numeric(arr: Any, filename: str, name: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise InputError(f"{filename}: tensor {name!r} is not numeric (dtype {getattr(arr, 'dtype', '?')})")
    return arr


# ------------------------------------------------------------------ images


def _np_dtype(row: Mapping[str, Any]) -> np.dtype[Any]:
    if "datatype" in row and row["datatype"] in oip.DATATYPES:
        return np.dtype(oip.DATATYPES[row["datatype"]]).newbyteorder("=")
    return np.dtype(str(row.get("dtype", "float32")))


def image_inputs(filename: str, data: bytes, inputs: Sequence[Mapping[str, Any]] | None,
                 input_name: str | None = None) -> dict[str, np.ndarray]:
    """An image as the model's image input: resized, laid out and scaled as its shape and datatype say."""
    if not inputs:
        raise InputError(f"{filename}: an image needs the model's input shape, which is unknown here "
                         "(run the fog broker with --http, or give a .npy/.npz/JSON tensor)")
    rows = [r for r in inputs if (input_name is None or r["name"] == input_name) and len(r["shape"]) in (3, 4)]
    if not rows:
        raise InputError(f"{filename}: the model has no image input (rank 3 or 4"
                         f"{', named ' + repr(input_name) if input_name else ''}); give a .npy/.npz/JSON tensor")
    row = rows[0]
    shape = [int(d) for d in row["shape"]]
    body = shape[-3:]
    if body[0] in (1, 3):
        layout, (c, h, w) = "CHW", body
    elif body[2] in (1, 3):
        layout, (h, w, c) = "HWC", body
    else:
        raise InputError(f"{filename}: input {row['name']!r} of shape {shape} is not an image of 1 or 3 "
                         "channels (NCHW or NHWC)")
    if len(shape) == 4 and shape[0] not in (1, -1):
        raise InputError(f"{filename}: input {row['name']!r} takes a batch of {shape[0]}; one image makes 1")
    dtype = _np_dtype(row)
    if dtype.kind not in "fu":
        raise InputError(f"{filename}: input {row['name']!r} is {dtype.name}; images fill float or uint8 inputs")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise InputError(f"{filename}: reading images needs Pillow (pip install pillow); "
                         "or give a .npy/.npz/JSON tensor") from None
    try:
        opened = Image.open(io.BytesIO(data))
        opened.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"{filename}: not a readable image ({_first_line(exc)})") from None
    img = opened.convert("L" if c == 1 else "RGB")
    size = (w if w > 0 else img.width, h if h > 0 else img.height)
    if img.size != size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if layout == "CHW":
        arr = arr.transpose(2, 0, 1)
    if len(shape) == 4:
        arr = arr[None]
    if dtype.kind == "f":
        arr = arr.astype(dtype) / dtype.type(255.0)
    return {str(row["name"]): np.ascontiguousarray(arr, dtype=dtype)}


def zoo_inputs(model_ref: str) -> list[dict[str, Any]] | None:
    """Input rows of a ``zoo:NAME`` model, built locally (None for any other reference)."""
    if not model_ref.startswith("zoo:"):
        return None
    import onnx  # heavy: only for an image of a zoo model

    from models import zoo
    name = model_ref[4:]
    if name not in zoo.NAMES:
        return None
    g = zoo.build(name).graph
    inits = {t.name for t in g.initializer}
    return [{"name": vi.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name,
             "shape": [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                       for d in vi.type.tensor_type.shape.dim]}
            for vi in g.input if vi.name not in inits]

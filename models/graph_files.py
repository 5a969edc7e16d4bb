"""The file shell of model analysis: reads a model file and its side files for the pure core.

``models.graph`` parses bytes and never touches the disk. A model given by its path comes in
through ``open_model`` as a ``ModelFile``: its bytes, read here, and a ``DiskSideFiles`` that
runs the ONNX checker on the file and reads the weights kept in side files (ONNX external data)
next to it, each a regular file inside that directory reached without a symlink
(``resolve_external``). ``load_model`` is ``models.graph.load_model`` for a path too.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_tensor

from models import graph
from models.errors import ModelError
from models.external import external_location_error

__all__ = ["DiskSideFiles", "open_model", "load_model", "resolve_external"]


def resolve_external(base_dir: str | os.PathLike[str], location: str, tensor: str = "?",
                     label: str = "") -> Path:
    """The side file ``location`` names in ``base_dir``: a regular file inside it, no symlink on the way.

    ModelError otherwise (one line). The lexical rules are ``external_location_error``'s; the
    real path must then equal the lexical one, so no component is a symlink (out or in).
    """
    why = external_location_error(location)
    if not why:
        base = os.path.realpath(base_dir)
        lexical = os.path.normpath(os.path.join(base, location))
        real = os.path.realpath(lexical)
        if real != lexical or not real.startswith(base.rstrip(os.sep) + os.sep):
            why = "a location through a symlink"
        elif not os.path.isfile(real):
            why = f"a missing side file {location[:200]!r}"
        else:
            return Path(real)
    raise ModelError(f"{label + ': ' if label else ''}weight {tensor[:64]!r}: external data must be "
                     f"a file next to the model, and it has {why}")


@dataclass(frozen=True, slots=True)
class DiskSideFiles:
    """The disk behind one model file (``graph.SideFiles``); plain data, so it pickles."""

    path: str
    directory: str

    def check(self) -> None:
        # The checker reads the file itself, so side files are found next to it, not in the
        # working directory.
        onnx.checker.check_model(self.path)

    def check_location(self, location: str, tensor: str, label: str) -> None:
        resolve_external(self.directory, location, tensor, label)

    def load(self, tensor: onnx.TensorProto, location: str, label: str) -> None:
        resolve_external(self.directory, location, tensor.name, label)
        try:
            load_external_data_for_tensor(tensor, self.directory)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{label}: cannot read the external data of weight "
                             f"'{tensor.name}' from {self.directory}: {exc}") from None


def open_model(path: str | os.PathLike[str]) -> graph.ModelFile:
    """The model file at ``path`` read for ``models.graph``; ModelError (one line) if unreadable."""
    label = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ModelError(f"{label}: no such file") from None
    except OSError as exc:
        raise ModelError(f"{label}: cannot read: {exc.strerror}") from None
    return graph.ModelFile(data, label, DiskSideFiles(os.fspath(path),
                                                      str(Path(path).resolve().parent)))


def source(src: graph.ModelSource | str | os.PathLike[str]) -> graph.ModelSource:
    """``src`` as the core takes it: a path opened, anything else as given."""
    return open_model(src) if isinstance(src, (str, os.PathLike)) else src


def load_model(src: graph.ModelSource | str | os.PathLike[str], *,
               dims: Mapping[str, int] | None = None,
               input_shapes: graph.InputShapes | None = None) -> onnx.ModelProto:
    """``models.graph.load_model`` that also takes a path."""
    return graph.load_model(source(src), dims=dims, input_shapes=input_shapes)

"""Weights in side files (ONNX external data): where a model may say they are, and where not.

A tensor with ``data_location = EXTERNAL`` names a file by its ``location`` entry, and
onnx and onnxruntime resolve it against the model file's directory, or, for a model given
as bytes, against the working directory of whoever loads it. Model bytes that came from
anyone else (an upload, a release, a partition) are data, never paths: ``external_tensors``
finds every such tensor so callers refuse them. Only a model file on the user's own disk
(``fogline models split``) may keep side files, and each must be a regular file inside that
file's directory, reached without a symlink (``models.graph_files.resolve_external``, the
shell: this module is pure).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PureWindowsPath

import onnx

__all__ = ["ExternalTensor", "external_location_error", "external_tensors", "inline_only",
           "location_of", "uses_external_data"]

_SEP = re.compile(r"[\\/]")


@dataclass(frozen=True, slots=True)
class ExternalTensor:
    """A tensor whose bytes live in a side file; ``initializer``: a top-level graph initializer."""

    name: str
    location: str
    initializer: bool


def uses_external_data(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def location_of(t: onnx.TensorProto) -> str:
    return next((e.value for e in t.external_data if e.key == "location"), "")


def _graph_tensors(g: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph holds: initializers, sparse ones, node attributes, subgraphs."""
    yield from g.initializer
    for s in g.sparse_initializer:
        yield from (s.values, s.indices)
    for node in g.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        for s in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + list(a.sparse_tensors):
            yield from (s.values, s.indices)
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            yield from _graph_tensors(sub)


def external_tensors(model: onnx.ModelProto) -> list[ExternalTensor]:
    """Every tensor of ``model`` (functions and subgraphs included) kept in a side file. Pure."""
    g = model.graph
    top = [ExternalTensor(t.name, location_of(t), True) for t in g.initializer if uses_external_data(t)]
    inner = [t for s in g.sparse_initializer for t in (s.values, s.indices)]
    inner += [t for node in g.node for t in _node_tensors(node)]
    inner += [t for f in model.functions for node in f.node for t in _node_tensors(node)]
    return top + [ExternalTensor(t.name, location_of(t), False) for t in inner if uses_external_data(t)]


def inline_only(what: str, tensor: str) -> str:
    """The one-line refusal of model bytes with a side file (the location is not echoed). Pure."""
    return (f"{what} keeps weight {tensor[:64]!r} in an external data file; a model given as "
            f"bytes must carry its weights inline (save it without save_as_external_data)")


def external_location_error(location: str) -> str:
    """Why ``location`` may not name a side file of a model ('' when it may). Pure: no I/O.

    Only a plain relative path below the model's directory: no absolute path (POSIX or a
    Windows drive), no ``..`` component, no NUL, not empty.
    """
    if not location:
        return "no location"
    if "\x00" in location:
        return "a NUL in its location"
    if location.startswith(("/", "\\")) or PureWindowsPath(location).drive:
        return "an absolute location"
    if ".." in _SEP.split(location):
        return "a location with '..'"
    return ""

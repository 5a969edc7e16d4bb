"""Aggregation rules vs Flower's on the same data: time, peak memory, distance exactness.

    python -m benchmarks.aggregation_bench [--quick] [--rules krum,multi_krum]
    fogline bench aggregation [--quick] [--rules ...]

Two measurements. "from replies" is what a ServerApp pays: n Flower reply
Messages (each an ArrayRecord of 3 layers, float32) to the aggregated
ArrayRecord, ``RobustStrategy.aggregate_train`` (checks, zero-copy views of the
reply buffers, the rule, the new ArrayRecord) against Flower 1.41's own
strategies' ``aggregate_train`` on identical replies (rebuilt untimed for every
run: FedMedian and FedTrimmedAvg consume theirs). "in memory" is the rule alone on
a stacked (n, d) update matrix against Flower's aggregation functions.

Prints JSON on stdout and writes out/bench/aggregation.json. BLAS and OpenMP are
pinned to one thread (environment variables set before numpy is imported, plus
threadpoolctl when it is installed), so Flower's code runs single-threaded.
Fogline's column passes (Gram matrices, weighted sums) run on
``aggregation.workers()`` threads, each calling that single-threaded BLAS (the
usable cores, at most 4, when BLAS is pinned; ``FOGLINE_AGG_THREADS`` overrides):
``fogline_s`` / ``speedup`` are that default, and ``fogline_1w_s`` /
``speedup_1w`` the same code on one worker (``FOGLINE_AGG_THREADS=1``, every
core but one idle), so neither figure hides the other. Timings are the best of
``--repeat`` runs, the variants interleaved so all see the same background load
(the 1-minute load average is recorded). Peak extra memory is tracemalloc's
peak (numpy reports its buffers to tracemalloc) in a separate, untimed run.
"""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks._emit import emit  # noqa: E402
from cloud_coordinator import aggregation as agg  # noqa: E402


def _thread_limit() -> tuple[contextlib.AbstractContextManager[Any], str]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext(), "env vars (OPENBLAS/OMP/MKL_NUM_THREADS=1)"
    return threadpool_limits(limits=1), "env vars + threadpoolctl.threadpool_limits(1)"


def make_updates(n: int, d: int, f: int, seed: int = 0) -> np.ndarray:
    """Late-training-like updates: a shared direction, small client noise, f outliers."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, d), dtype=np.float32)
    g = rng.standard_normal(d, dtype=np.float32) * np.float32(1e-3)
    for i in range(n):
        x[i] = g + rng.standard_normal(d, dtype=np.float32) * np.float32(2e-4)
    x[n - f:] = -4.0 * g  # sign-flipped, scaled Byzantine rows
    return x


@contextlib.contextmanager
def _one_worker() -> Any:
    """Fogline's column passes on one thread (``FOGLINE_AGG_THREADS=1``) inside the block."""
    old = os.environ.get("FOGLINE_AGG_THREADS")
    os.environ["FOGLINE_AGG_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FOGLINE_AGG_THREADS", None)
        else:
            os.environ["FOGLINE_AGG_THREADS"] = old


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def flower_baselines(x: np.ndarray, f: int, m: int) -> dict[str, Callable[[], object]]:
    """Flower 1.41's own aggregation code paths on the same rows (records built untimed)."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.server.strategy.aggregate import aggregate_median
    from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
    from flwr.serverapp.strategy.multikrum import select_multikrum
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    n = x.shape[0]
    contents = [RecordDict({"arrays": ArrayRecord([x[i]]),
                            "metrics": MetricRecord({"num-examples": 1})}) for i in range(n)]
    layers = [[x[i]] for i in range(n)]
    theta = n - 2 * f
    beta = theta - 2 * f

    def krum() -> object:
        return aggregate_arrayrecords(select_multikrum(contents, f, 1), "num-examples")

    def multi_krum() -> object:
        return aggregate_arrayrecords(select_multikrum(contents, f, m), "num-examples")

    def median() -> object:  # FedMedian: np.median over the stacked layer
        return aggregate_median([(ls, 1) for ls in layers])

    def trimmed() -> object:  # FedTrimmedAvg(beta=f/n)
        return trim_mean(np.stack([ls[0] for ls in layers]), f / n)

    def mean() -> object:  # FedAvg
        return aggregate_arrayrecords(contents, "num-examples")

    def bulyan() -> object:  # serverapp Bulyan.aggregate_train's arithmetic
        sel = select_multikrum(contents, f, theta)
        nds = [rd["arrays"].to_numpy_ndarrays() for rd in sel]  # type: ignore[union-attr]
        med = [np.median(arr, axis=0) for arr in zip(*nds, strict=True)]
        return aggregate_n_closest_weights(med, nds, beta)

    return {"mean": mean, "median": median, "trimmed_mean": trimmed, "krum": krum,
            "multi_krum": multi_krum, "bulyan": bulyan}


def ours(x: np.ndarray, f: int, m: int) -> dict[str, Callable[[], object]]:
    """Fogline's rules, called the way the coordinator calls them (Aggregator objects)."""
    names: dict[str, dict[str, Any]] = {
        "mean": {}, "median": {}, "trimmed_mean": {}, "krum": {}, "multi_krum": {"m": m},
        "bulyan": {}, "geometric_median": {}, "centered_clipping": {}, "nnm+trimmed_mean": {},
        agg.DEFAULT_RULE: {}}

    def call(rule: agg.Aggregator) -> Callable[[], object]:
        return lambda: rule.aggregate(x)
    return {k: call(agg.get_rule(k, f, **kw)) for k, kw in names.items()}


def distance_exactness(n: int, d: int, seed: int = 1) -> dict[str, float]:
    """Max relative error of pairwise distances vs direct float64, late in training.

    Global weights of norm ~1 per coordinate, client updates ~1e-4: Flower gets raw
    weights (its API) and computes ||a||^2 + ||b||^2 - 2ab in float32; Fogline gets
    updates. Both are compared with the direct float64 distance of the same rows.
    """
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy.multikrum import compute_distances

    rng = np.random.default_rng(seed)
    glob = rng.standard_normal(d).astype(np.float32)
    upd = (rng.standard_normal((n, d)) * 1e-4).astype(np.float32)
    weights = glob + upd
    exact_w = agg.direct_sq_distances(weights)
    exact_u = agg.direct_sq_distances(upd)
    iu = np.triu_indices(n, 1)
    fl = compute_distances([ArrayRecord([weights[i]]) for i in range(n)])
    ours_d = agg.pairwise_sq_distances(upd)
    return {
        "flower_max_rel_err": float(np.max(np.abs(fl[iu] - exact_w[iu]) / exact_w[iu])),
        "flower_negative_distances": int(np.sum(fl[iu] < 0)),
        "fogline_max_rel_err": float(np.max(np.abs(ours_d[iu] - exact_u[iu]) / exact_u[iu])),
    }


LAYERS = ((0.5, "conv.weight"), (0.001, "conv.bias"), (0.499, "fc.weight"))


def reply_messages(x: np.ndarray, glob: np.ndarray) -> tuple[Any, list[Any]]:
    """(global ArrayRecord, reply Messages) carrying ``glob + x[i]`` split into three named layers."""
    from flwr.app import Array, ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    d = x.shape[1]
    cuts = np.cumsum([int(f * d) for f, _ in LAYERS[:-1]])
    names = [n for _, n in LAYERS]

    def record(vec: np.ndarray) -> Any:
        return ArrayRecord({n: Array(np.ascontiguousarray(p)) for n, p in zip(names, np.split(vec, cuts))})

    # Replies with chosen ids outside a run: Flower's metadata= constructor, not in its overloads
    # (reply_to= needs a live run's TaskIdentity).
    msgs = [Message(RecordDict({"arrays": record((glob + x[i]).astype(np.float32)),  # type: ignore[call-overload]
                                "metrics": MetricRecord({"num-examples": 100})}),
                    metadata=Metadata(1, f"m{i}", 1000 + i, 0, f"q{i}", "1", 0.0, 60.0, "train"))
            for i in range(x.shape[0])]
    return record(glob), msgs


def from_replies(x: np.ndarray, f: int, m: int, repeat: int,
                 only: set[str] | None = None) -> list[dict[str, Any]]:
    """Flower reply Messages -> aggregate: RobustStrategy.aggregate_train vs Flower's strategies."""
    import logging

    from flwr.serverapp.strategy import Bulyan, FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum

    from cloud_coordinator.strategy import RobustStrategy, RoundConfig

    logging.getLogger("flwr").setLevel(logging.ERROR)
    n = x.shape[0]
    d: int = x.shape[1]
    glob = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    flower = {"mean": lambda: FedAvg(), "median": lambda: FedMedian(),
              "trimmed_mean": lambda: FedTrimmedAvg(beta=f / n), "krum": lambda: Krum(num_malicious_nodes=f),
              "multi_krum": lambda: MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m),
              "bulyan": lambda: Bulyan(num_malicious_nodes=f)}
    rows = []
    multi = agg.workers() > 1
    for name, make in flower.items():
        if only is not None and name not in only:
            continue
        ours_t, ours1_t, theirs_t = float("inf"), float("inf"), float("inf")
        kw = {"rule_options": {"m": m}} if name == "multi_krum" else {}

        def run_ours(name: str = name, kw: dict[str, Any] = kw) -> float:
            arrays, msgs = reply_messages(x, glob)
            s = RobustStrategy(name, f=0 if name == "mean" else f, **kw, rounds=RoundConfig(min_train_nodes=1))
            s.prepare(arrays)
            t0 = time.perf_counter()
            out, _ = s.aggregate_train(1, msgs)
            t = time.perf_counter() - t0
            assert out is not None
            return t

        for _ in range(repeat):
            ours_t = min(ours_t, run_ours())
            if multi:
                with _one_worker():
                    ours1_t = min(ours1_t, run_ours())
            _, msgs = reply_messages(x, glob)
            strat = make()
            t0 = time.perf_counter()
            strat.aggregate_train(1, msgs)
            theirs_t = min(theirs_t, time.perf_counter() - t0)
            del msgs
        row = {"rule": name, "fogline_s": round(ours_t, 4), "flower_s": round(theirs_t, 4),
               "speedup": round(theirs_t / ours_t, 2)}
        if multi:
            row.update(fogline_1w_s=round(ours1_t, 4), speedup_1w=round(theirs_t / ours1_t, 2))
        rows.append(row)
        print(json.dumps({"from_replies": row}), file=sys.stderr)
    return rows


def run(quick: bool, repeat: int, only: set[str] | None = None,
        replies_repeat: int | None = None) -> dict[str, Any]:
    n, f, m = 50, 10, 30
    d = 100_000 if quick else 1_000_000
    x = make_updates(n, d, f)
    load0 = round(os.getloadavg()[0], 2)
    limit, pin = _thread_limit()
    with limit:
        fl = flower_baselines(x, f, m)
        mine = ours(x, f, m)
        nworkers = agg.workers()
        read_once = _best(lambda: x.sum(axis=0, dtype=np.float64), repeat)
        rows = []
        for name, fn in mine.items():
            if only is not None and name not in only:
                continue
            # Interleave the variants so all see the same background load.
            t, t1, tf = float("inf"), float("inf"), float("inf")
            for _ in range(repeat):
                t = min(t, _best(fn, 1))
                if nworkers > 1:
                    with _one_worker():
                        t1 = min(t1, _best(fn, 1))
                if name in fl:
                    tf = min(tf, _best(fl[name], 1))
            peak = _peak(fn)
            row: dict[str, Any] = {"rule": name, "fogline_s": round(t, 4),
                                   "peak_extra_bytes": peak,
                                   "peak_extra_x_input": round(peak / x.nbytes, 3)}
            if nworkers > 1:
                row["fogline_1w_s"] = round(t1, 4)
            if name in fl:
                row.update(flower_s=round(tf, 4), speedup=round(tf / t, 2),
                           flower_peak_extra_x_input=round(_peak(fl[name]) / x.nbytes, 3))
                if nworkers > 1:
                    row["speedup_1w"] = round(tf / t1, 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        exact = distance_exactness(20, 20_000 if quick else 200_000)
        replies = from_replies(x, f, m, replies_repeat or max(2, repeat // 2), only)
    return {
        "benchmark": "aggregation", "quick": quick, "n": n, "d": d, "f": f, "multi_krum_m": m,
        "dtype": "float32", "input_bytes": int(x.nbytes), "threads": pin,
        "fogline_workers": nworkers, "cores": len(os.sched_getaffinity(0)),
        "one_read_of_data_s": round(read_once, 4), "repeat": repeat,
        "load_average_1min_start_end": [load0, round(os.getloadavg()[0], 2)],
        "numpy": np.__version__, "python": platform.python_version(),
        "flower": _flower_version(), "from_replies": replies, "rules": rows, "distance_exactness": exact,
    }


def _flower_version() -> str:
    try:
        from importlib.metadata import version
        return version("flwr")
    except Exception:  # noqa: BLE001 - version is informative only
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; JSON to stdout and out/bench/aggregation.json."""
    ap = argparse.ArgumentParser(prog="fogline bench aggregation",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="d=100,000 instead of 1,000,000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--replies-repeat", type=int, default=None,
                    help="runs per rule from replies (default: max(2, repeat // 2))")
    ap.add_argument("--rules", default="",
                    help="comma-separated rules to time (default: all), e.g. krum,multi_krum")
    args = ap.parse_args(argv)
    only = {r.strip() for r in args.rules.split(",") if r.strip()} or None
    result = run(args.quick, args.repeat, only, args.replies_repeat)
    emit("aggregation", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

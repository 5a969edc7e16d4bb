"""Two-level (hierarchical) robust aggregation against flat aggregation: WAN bytes and accuracy.

    fogline bench hierarchy [--quick] [--sites S] [--per-site K] [--rounds R] [--seeds N]

Federated softmax regression on scikit-learn's digits (``models.train``, the
digits app's trainer), S sites of K devices each, the same aggregation code
the coordinator (``RobustStrategy``) and each site (``fogline
site-aggregator``) run, in one process:

* **flat**: the cloud aggregates all S*K device updates (FedAvg's mean, and
  the robust rule with f = the Byzantine devices it must survive);
* **two-level**: each site aggregates its K devices (``site_rule``, f=1),
  the cloud aggregates the S site updates (``cloud_rule``, f=1).

Scenarios: honest; Byzantine devices inside sites (one sign-flipping device
in each of the first S-1 sites: more than a flat f=1 rule can absorb, one
per site for the two-level one); a Byzantine site (every device of site 0
sign-flips, or equivalently the site's fog sends a sign-flipped aggregate).

WAN bytes per round are the sizes of what would cross it, serialised by
Flower itself (``flwr``'s protobuf serde of the train Message's content and
of its reply's), per device (flat) or per site (two-level).
The integration test ``test_hierarchical_rounds`` measures the real bytes
through a proxy in front of the cloud SuperLink.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._emit import OUT_DIR, emit
from cloud_coordinator import aggregation as agg
from models.digits import load_digits_split
from models.train import SoftmaxRegression

OUT_PNG = OUT_DIR / "hierarchy.png"
SCENARIOS = ("honest", "byzantine-devices", "byzantine-site")


def _exchange_bytes(weights: list[np.ndarray]) -> int:
    """Bytes of one train Message's content and its reply's, as Flower serialises them (protobuf RecordDict).

    A Message can only be built inside a Flower task, so this counts the contents (all of the
    arrays; the metadata around them is a few dozen bytes), serialised by Flower's own serde.
    """
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
    from flwr.common.serde import recorddict_to_proto

    arrays = ArrayRecord({f"w{i}": Array(w) for i, w in enumerate(weights)})
    down = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1, "round-timeout": 60.0})})
    up = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 100, "train_loss": 0.5})})
    return int(recorddict_to_proto(down).ByteSize() + recorddict_to_proto(up).ByteSize())


def _local(model: SoftmaxRegression, w: list[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> np.ndarray:
    model.set_weights(w)
    model.fit(x, y, epochs=1, lr=lr)
    return np.concatenate([a.ravel() for a in model.get_weights()]).astype(np.float64)


def _aggregate(rule: agg.Aggregator, rows: np.ndarray, base: np.ndarray) -> np.ndarray:
    new: np.ndarray = base + rule.aggregate(rows, None, base=base).update
    return new


def run(sites: int, per_site: int, rounds: int, seed: int, scenario: str, *, lr: float = 0.1,
        flat_rule: str = "trimmed_mean", site_rule: str = "trimmed_mean",
        cloud_rule: str = "median") -> dict[str, float]:
    n = sites * per_site
    data = load_digits_split(n, seed=seed)
    xt, yt = data.test
    model = SoftmaxRegression(seed=seed)
    shapes = [a.shape for a in model.get_weights()]
    sizes = [int(np.prod(s)) for s in shapes]

    def unflat(v: np.ndarray) -> list[np.ndarray]:
        out, i = [], 0
        for s, k in zip(shapes, sizes):
            out.append(v[i:i + k].reshape(s).astype(np.float32))
            i += k
        return out

    byz = set()
    if scenario == "byzantine-devices":
        byz = {s * per_site for s in range(sites - 1)}            # one device in each of the first S-1 sites
    elif scenario == "byzantine-site":
        byz = set(range(per_site))                               # every device of site 0
    f_flat = max(1, len(byz))
    flat_mean = agg.get_rule("mean", 0)
    flat_robust = agg.get_rule(flat_rule, 1)                     # what a flat deployment sized for f=1 runs
    flat_sized = agg.get_rule(flat_rule, f_flat) if 2 * f_flat < n else None  # sized for the real attackers
    site_agg = [agg.get_rule(site_rule, 1) for _ in range(sites)]
    cloud_agg = agg.get_rule(cloud_rule, 1)
    start = np.concatenate([a.ravel() for a in model.get_weights()]).astype(np.float64)
    glob = {"flat-mean": start.copy(), "flat-robust-f1": start.copy(), "two-level": start.copy()}
    if flat_sized is not None:
        glob[f"flat-robust-f{f_flat}"] = start.copy()
    for _ in range(rounds):
        for name, g in list(glob.items()):
            w = unflat(g)
            rows = np.stack([_local(model, w, *data.clients[i], lr) for i in range(n)])
            for i in byz:
                rows[i] = g - 4.0 * (rows[i] - g)                     # sign flip, amplified
            if name == "flat-mean":
                glob[name] = _aggregate(flat_mean, rows, g)
            elif name == "flat-robust-f1":
                glob[name] = _aggregate(flat_robust, rows, g)
            elif name.startswith("flat-robust-f"):
                assert flat_sized is not None
                glob[name] = _aggregate(flat_sized, rows, g)
            else:
                site_rows = np.stack([_aggregate(site_agg[s], rows[s * per_site:(s + 1) * per_site], g)
                                      for s in range(sites)])
                glob[name] = _aggregate(cloud_agg, site_rows, g)
    out = {}
    for name, g in glob.items():
        model.set_weights(unflat(g))
        out[name] = float(model.evaluate(xt, yt)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fogline bench hierarchy", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--per-site", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    args = ap.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 15)
    seeds = args.seeds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    model = SoftmaxRegression()
    per_update = _exchange_bytes(model.get_weights())
    n = args.sites * args.per_site
    wan = {"bytes_per_device_exchange": per_update, "flat_bytes_per_round": n * per_update,
           "two_level_bytes_per_round": args.sites * per_update,
           "ratio_flat_over_two_level": n / args.sites}
    table: dict[str, dict[str, float]] = {}
    for sc in SCENARIOS:
        accs: dict[str, list[float]] = {}
        for seed in range(seeds):
            for k, v in run(args.sites, args.per_site, rounds, seed, sc).items():
                accs.setdefault(k, []).append(v)
        table[sc] = {k: float(np.mean(v)) for k, v in accs.items()}
        print(f"{sc:18s} " + "  ".join(f"{k} {v:.3f}" for k, v in table[sc].items()), file=sys.stderr)
    result = {"benchmark": "hierarchy", "sites": args.sites, "per_site": args.per_site, "rounds": rounds,
              "seeds": seeds, "wan": wan, "accuracy": table,
              "rules": {"flat": "trimmed_mean", "site": "trimmed_mean f=1", "cloud": "median f=1"},
              "seconds": time.perf_counter() - t0}
    _plot(table)
    emit("hierarchy", result)
    return 0


def _plot(table: dict[str, dict[str, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = sorted({k for row in table.values() for k in row})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(table))], [table[s].get(name, 0.0) for s in table], width,
               label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(table))], list(table))
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title("flat vs two-level robust aggregation (digits)")
    fig.tight_layout()
    OUT_PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT_PNG, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

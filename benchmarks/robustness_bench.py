"""Robustness of each aggregation rule under Byzantine attacks, worst case per rule.

    python -m benchmarks.robustness_bench [--quick] [--rules a,b] [--seeds k] [--rounds r]

Federated softmax regression on scikit-learn's bundled digits (numpy only, no
Flower; the same aggregation code the coordinator runs): n=25 clients, f=5
Byzantine, IID and Dirichlet(0.5) splits, attacks from cloud_coordinator.attacks
(sign flip, IPM eps=0.1, ALIE, label flip, Gaussian, and adaptive ALIE / IPM that
re-tune their strength every round against the rule, which they know). Prints
the table on stderr, JSON on stdout and out/bench/robustness.json, and a PNG at
out/bench/robustness.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import OUT_DIR, emit
from cloud_coordinator import aggregation as agg
from cloud_coordinator import attacks as atk

OUT_JSON = OUT_DIR / "robustness.json"
OUT_PNG = OUT_DIR / "robustness.png"

RULES = ("mean", "median", "trimmed_mean", "krum", "bulyan", "geometric_median",
         "centered_clipping", "nnm+trimmed_mean", "bucketing+centered_clipping",
         "nnm+centered_clipping")
ATTACKS = tuple(a for a in atk.ATTACKS if a != "none")
N_CLIENTS, F = 25, 5
N_CLASSES = 10


@dataclass(frozen=True, slots=True)
class Setup:
    """Hyper-parameters of the federated run (the trainer is local to this module)."""

    rounds: int
    local_steps: int = 10
    lr: float = 2.0
    l2: float = 1e-4


# ----------------------------------------------------------------------------- data + model
# models.train was not available when this was written; this is the minimal
# numpy softmax-regression trainer the experiment needs, kept private here.


def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits (8x8, scaled to [0, 1]) with a bias column; stratified 80/20 split."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = np.hstack([ds.data / 16.0, np.ones((len(ds.data), 1))])
    y = ds.target.astype(np.intp)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(N_CLASSES):
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: len(idx) // 5]] = True
    return x[~test], y[~test], x[test], y[test]


def partition(y: np.ndarray, n: int, alpha: float | None, rng: np.random.Generator
              ) -> list[np.ndarray]:
    """IID (alpha None) or Dirichlet(alpha) label skew; every client gets >= 10 samples."""
    if alpha is None:
        return list(np.array_split(rng.permutation(len(y)), n))
    while True:
        parts: list[list[int]] = [[] for _ in range(n)]
        for c in range(N_CLASSES):
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha))) * len(idx)).astype(int)[:-1]
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].extend(chunk.tolist())
        if min(len(p) for p in parts) >= 10:
            return [np.asarray(p) for p in parts]


@dataclass(frozen=True, slots=True)
class Clients:
    """Every client's data padded into one batch, classes on the middle axis so the
    softmax reductions run across contiguous samples (numpy is slow over a short
    last axis)."""

    x: np.ndarray        # (C, m, k)
    xt: np.ndarray       # (C, k, m)
    onehot: np.ndarray   # (C, classes, m), zero columns for padding
    valid: np.ndarray    # (C, 1, m), 1 for real samples
    count: np.ndarray    # (C, 1, 1)

    @staticmethod
    def build(x: np.ndarray, ys: list[np.ndarray], parts: list[np.ndarray]) -> Clients:
        m = max(len(p) for p in parts)
        xs = np.zeros((len(parts), m, x.shape[1]))
        oh = np.zeros((len(parts), N_CLASSES, m))
        valid = np.zeros((len(parts), 1, m))
        for i, (p, y) in enumerate(zip(parts, ys)):
            xs[i, : len(p)] = x[p]
            oh[i, y, np.arange(len(p))] = 1.0
            valid[i, 0, : len(p)] = 1.0
        cnt = np.array([len(p) for p in parts], dtype=np.float64)[:, None, None]
        return Clients(xs, np.ascontiguousarray(np.swapaxes(xs, 1, 2)), oh, valid, cnt)


def local_train(theta: np.ndarray, c: Clients, s: Setup) -> np.ndarray:
    """Full-batch gradient steps on softmax cross-entropy for every client at once.

    Returns the updates (C, d), i.e. local weights minus the global weights.
    """
    k = c.x.shape[2]
    wt = np.broadcast_to(theta.reshape(k, N_CLASSES).T, (c.x.shape[0], N_CLASSES, k)).copy()
    for _ in range(s.local_steps):
        z = wt @ c.xt                       # (C, classes, m)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        z -= c.onehot
        z *= c.valid
        grad = z @ c.x / c.count            # (C, classes, k)
        wt -= s.lr * (grad + s.l2 * wt)
    updates: np.ndarray = np.swapaxes(wt, 1, 2).reshape(c.x.shape[0], -1) - theta
    return updates


def accuracy(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ theta.reshape(x.shape[1], N_CLASSES), axis=1) == y))


# ----------------------------------------------------------------------------- one run


def _clone(a: agg.Aggregator, rule: str, seed: int) -> agg.Aggregator:
    c = agg.get_rule(rule, F, seed=seed)
    c.load_state_dict(a.state_dict())
    return c


def run_one(rule: str, attack: str, alpha: float | None, seed: int, s: Setup,
            data: tuple[np.ndarray, ...]) -> float:
    """Train for s.rounds under one attack; return the final test accuracy."""
    xtr, ytr, xte, yte = data
    rng = np.random.default_rng(seed)
    parts = partition(ytr, N_CLIENTS, alpha, rng)
    byz = (np.sort(rng.choice(N_CLIENTS, F, replace=False)) if attack != "none"
           else np.array([], dtype=np.intp))
    honest = np.setdiff1d(np.arange(N_CLIENTS), byz)
    ys = [atk.flip_labels(ytr[p], N_CLASSES) if (attack == "label_flip" and i in byz)
          else ytr[p] for i, p in enumerate(parts)]
    clients = Clients.build(xtr, ys, parts)
    a = agg.get_rule(rule, F, seed=seed)
    attack_rng = np.random.default_rng(seed + 10_000)
    theta = np.zeros(xtr.shape[1] * N_CLASSES)

    def place(h: np.ndarray, b: np.ndarray) -> np.ndarray:
        u = np.empty((N_CLIENTS, h.shape[1]))
        u[honest] = h
        u[byz] = b
        return u

    for _ in range(s.rounds):
        trained = local_train(theta, clients, s)
        hon = trained[honest]
        if attack == "none":
            bad = np.empty((0, theta.size))
        elif attack == "label_flip":
            bad = trained[byz]
        elif attack == "sign_flip":
            bad = atk.sign_flip(hon, F)
        elif attack == "ipm":
            bad = atk.ipm(hon, F, eps=0.1)
        elif attack == "alie":
            bad = atk.alie(hon, F, n=N_CLIENTS)
        elif attack == "gaussian":
            bad = atk.gaussian(hon, F, rng=attack_rng)
        elif attack in ("adaptive_alie", "adaptive_ipm"):
            def probe(u: np.ndarray) -> np.ndarray:
                return _clone(a, rule, seed).aggregate(u).update
            fn = atk.adaptive_alie if attack == "adaptive_alie" else atk.adaptive_ipm
            bad = fn(hon, F, probe, place=place).byzantine
        else:
            raise ValueError(f"unknown attack {attack!r}")
        theta = theta + a.aggregate(place(hon, bad)).update
    return accuracy(theta, xte, yte)


# ----------------------------------------------------------------------------- grid + report


def run_grid(rules: tuple[str, ...], seeds: int, s: Setup, dists: dict[str, float | None],
             log: Callable[[str], None]) -> dict[str, Any]:
    acc: dict[str, dict[str, dict[str, list[float]]]] = {}
    for dname, alpha in dists.items():
        acc[dname] = {}
        for rule in rules:
            acc[dname][rule] = {}
            for attack in ("none", *ATTACKS):
                vals = []
                for seed in range(seeds):
                    data = load_digits_split(seed)
                    vals.append(run_one(rule, attack, alpha, seed, s, data))
                acc[dname][rule][attack] = vals
            worst = min(float(np.mean(acc[dname][rule][k])) for k in ATTACKS)
            log(f"{dname:>13} {rule:<28} clean {np.mean(acc[dname][rule]['none']):.3f}"
                f"  worst {worst:.3f}")
    return acc


def summarise(acc: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dname, per_rule in acc.items():
        rows = {}
        for rule, per_attack in per_rule.items():
            means = {k: round(float(np.mean(v)), 4) for k, v in per_attack.items()}
            worst_attack = min(ATTACKS, key=lambda k: means[k])
            rows[rule] = {"accuracy": means, "worst": means[worst_attack],
                          "worst_attack": worst_attack}
        out[dname] = rows
    return out


def table(summary: dict[str, Any]) -> str:
    cols = ("none", *ATTACKS)
    lines = []
    for dname, rows in summary.items():
        lines.append(f"\n{dname}: final test accuracy (%), mean over seeds; "
                     "worst = min over attacks")
        lines.append(f"{'rule':<28}" + "".join(f"{c[:11]:>12}" for c in cols) + f"{'WORST':>8}")
        for rule, r in rows.items():
            lines.append(f"{rule:<28}" + "".join(f"{100 * r['accuracy'][c]:>12.1f}" for c in cols)
                         + f"{100 * r['worst']:>8.1f}")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dnames = list(summary)
    rules = list(summary[dnames[0]])
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(dnames)
    for k, dname in enumerate(dnames):
        worst = [100 * summary[dname][r]["worst"] for r in rules]
        bars = ax.bar(np.arange(len(rules)) + k * width, worst, width, label=f"{dname} worst case")
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
        clean = 100 * summary[dname]["mean"]["accuracy"]["none"] if "mean" in rules else None
        if clean is not None:
            ax.axhline(clean, ls="--", lw=1, color=f"C{k}", label=f"{dname} clean FedAvg")
    ax.set_xticks(np.arange(len(rules)) + width * (len(dnames) - 1) / 2)
    ax.set_xticklabels(rules, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Worst case over {len(ATTACKS)} attacks, n={N_CLIENTS}, f={F}, digits softmax")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the experiment; table to stderr, JSON to stdout and out/bench/robustness.json."""
    ap = argparse.ArgumentParser(prog="fogline bench robustness",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, 25 rounds, Dirichlet only (< 60 s)")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--rounds", type=int)
    args = ap.parse_args(argv)
    rules = tuple(r for r in args.rules.split(",") if r)
    for r in rules:
        agg.get_rule(r, F)  # fail fast on a bad name
    seeds = args.seeds or (1 if args.quick else 3)
    s = Setup(rounds=args.rounds or (25 if args.quick else 60))
    dists: dict[str, float | None] = (
        {"dirichlet0.5": 0.5} if args.quick else {"iid": None, "dirichlet0.5": 0.5})
    t0 = time.perf_counter()
    acc = run_grid(rules, seeds, s, dists, lambda m: print(m, file=sys.stderr, flush=True))
    summary = summarise(acc)
    print(table(summary), file=sys.stderr)
    result = {
        "benchmark": "robustness", "quick": args.quick, "n_clients": N_CLIENTS, "f": F,
        "seeds": seeds, "rounds": s.rounds, "local_steps": s.local_steps, "lr": s.lr,
        "model": "softmax regression (numpy, local to this benchmark)", "data": "sklearn digits",
        "attacks": list(ATTACKS), "default_rule": agg.DEFAULT_RULE, "summary": summary,
        "raw": acc, "seconds": round(time.perf_counter() - t0, 1),
    }
    emit("robustness", result, path=OUT_JSON, stdout={k: v for k, v in result.items() if k != "raw"})
    plot(summary, OUT_PNG)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

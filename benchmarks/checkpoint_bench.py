"""Young/Daly: the checkpoint interval the coordinator picks vs every round and never.

The failure rate is not assumed: it is measured from a churning simulated
fleet (``simulations.churn.fault_schedule``), fed to the coordinator's own
policy (``cloud_coordinator.policy.rounds_between_checkpoints``), and the
resulting schedule is run against the baselines on the same crash draws.
Run: ``python -m benchmarks.checkpoint_bench [--quick]``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

from benchmarks._emit import emit
from cloud_coordinator.policy import CheckpointPolicy, estimate_mtbf, rounds_between_checkpoints
from simulations.churn import FailureModel, fault_schedule
from simulations.goodput import RunModel, simulate_run


def measure_mtbf(true_mtbf_s: float, horizon_s: float, seed: int) -> tuple[float, int]:
    """MTBF as the coordinator would observe it: crashes of one process over a horizon."""
    faults = fault_schedule(["coordinator"], FailureModel(true_mtbf_s, mttr_s=5.0), horizon_s,
                            random.Random(seed))
    crashes = sum(1 for f in faults if f.kind == "crash")
    return estimate_mtbf(crashes, horizon_s, prior_mtbf_s=true_mtbf_s * 10), crashes


def run(quick: bool) -> dict:
    trials = 200 if quick else 2000
    cases = [  # (round seconds, checkpoint seconds, true MTBF seconds)
        (8.0, 2.0, 600.0),
        (8.0, 2.0, 3600.0),
        (30.0, 10.0, 1800.0),
        (2.0, 1.0, 300.0),
    ]
    results = []
    for round_s, ckpt_s, true_mtbf in cases:
        mtbf, crashes = measure_mtbf(true_mtbf, horizon_s=true_mtbf * 50, seed=7)
        policy = CheckpointPolicy(mode="daly", prior_mtbf_s=true_mtbf * 10, max_rounds_between=1000)
        every = rounds_between_checkpoints(policy, round_s, ckpt_s, crashes, true_mtbf * 50)
        model = RunModel(rounds=200, round_s=round_s, checkpoint_s=ckpt_s, restart_s=5.0, mtbf_s=true_mtbf)
        row: dict = {"round_s": round_s, "checkpoint_s": ckpt_s, "true_mtbf_s": true_mtbf,
                     "measured_mtbf_s": round(mtbf, 1), "daly_every_rounds": every}
        for name, k in (("daly", every), ("every_round", 1), ("never", None)):
            rng = random.Random(11)
            goodputs = []
            for _ in range(trials):
                out = simulate_run(model, k, rng, max_wall_s=model.rounds * model.round_s * 200)
                goodputs.append(out.goodput(model))
            row[f"goodput_{name}"] = round(statistics.fmean(goodputs), 4)
        row["daly_vs_every_round"] = round(row["goodput_daly"] / row["goodput_every_round"], 3)
        row["daly_vs_never"] = round(row["goodput_daly"] / max(row["goodput_never"], 1e-9), 3)
        results.append(row)
    return {"benchmark": "checkpoint", "trials": trials, "cases": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fogline bench checkpoint")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out = run(args.quick)
    for r in out["cases"]:
        print(f"round {r['round_s']:>4}s ckpt {r['checkpoint_s']:>4}s MTBF {r['true_mtbf_s']:>6.0f}s -> every "
              f"{r['daly_every_rounds']:>3} rounds: goodput daly {r['goodput_daly']:.3f} | every round "
              f"{r['goodput_every_round']:.3f} | never {r['goodput_never']:.3f}", file=sys.stderr)
    emit("checkpoint", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

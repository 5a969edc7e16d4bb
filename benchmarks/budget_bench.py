"""The cost of the per-identity budgets (issue 29): this tree against a baseline ref, side by side.

Run: ``python -m benchmarks.budget_bench [--quick] [--base main]``. The baseline is the same
benchmark code run from a temporary ``git worktree`` of ``--base`` (default ``main``), in
alternating rounds (this tree, base, this tree, base, ...) on the same machine, threads and
cores, so both see the same load. Each measurement runs in its own process with that tree first
on ``sys.path``:

* advert ingest CPU: ``benchmarks.fog_bench._intake_cpu`` (thread CPU time, not wall time, so a
  loaded machine does not decide it; best of 5 in each process): the single-thread cost of a
  session-MAC state's intake (budget, lane), check and registration, budgets on as shipped;
* signed advert ingest rate: ``benchmarks.fog_bench.bench_ingest`` (a real ``FogService`` over TLS
  mosquitto, verify worker processes, budgets on as shipped): verified states per second;
* HTTPS inference p50: a real secure fog with ``--http``, two real agents and onnxruntime serving
  ``zoo:mlp`` (``benchmarks.http_bench``'s helpers): p50 of sequential HTTPS JSON requests with a
  client certificate.

Prints JSON (``out/bench/budget.json``) with the figures per tree and the ratios (goal: base/this
>= 0.95 for the ingest CPU and the p50; the wall-clock rate is reported beside, noisy on a busy host).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._emit import emit, run_header

HERE = Path(__file__).resolve().parents[1]

INGEST = r"""
import json, sys, tempfile
from pathlib import Path
from benchmarks.fog_bench import bench_ingest
n, per = int(sys.argv[1]), int(sys.argv[2])
with tempfile.TemporaryDirectory(prefix="fogline-budget-bench-") as d:
    r = bench_ingest(n, per, 2, [("processes", 2, "sig", True)], Path(d), transport=False)
m = r["fog_verified_processes2_tls"]
print(json.dumps({"per_s": m["per_s"], "limited": m["limited"]}))
"""


CPU = r"""
import json, sys
from benchmarks.fog_bench import _intake_cpu
print(json.dumps(_intake_cpu(int(sys.argv[1]), int(sys.argv[2]), 5)))
"""

HTTPS = r"""
import json, os, sys, tempfile
from pathlib import Path
import numpy as np
from benchmarks.http_bench import OipConnection, latency, spawn_agents, wait_for, kill9
from simulations.local_site import LocalSite
rounds = int(sys.argv[1])
with tempfile.TemporaryDirectory(prefix="fogline-budget-http-") as d:
    tmp = Path(d)
    site = LocalSite(tmp / "fog", site=f"budget{os.getpid()}", log=tmp / "fog.log",
                     args=["--http", "0", "--state-interval", "1"]).start()
    proc = None
    try:
        proc = spawn_agents(site, [
            {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source"}},
            {"id": "w0", "memory": 50_000_000, "labels": {"role": "lat"}}], tmp / "agents", tmp / "agents.log")
        admin = site.client()
        wait_for(lambda: {d["id"] for d in admin.status()["devices"] if d["alive"]} >= {"cam", "w0"}, 60, "alive")
        admin.deploy({"name": "mlp", "model": "zoo:mlp", "source": "cam", "sink": "cam", "selectors": {"role": "lat"}})
        admin.wait_running("mlp", 60)
        creds = site.credentials("admin")
        conn = OipConnection(site.ready["http"], ca=str(creds / "ca.pem"),
                             cert=(str(creds / "cert.pem"), str(creds / "key.pem")))
        x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
        lat = latency({"http_json_cert": lambda: conn.infer("mlp", x)}, rounds)
        print(json.dumps({"p50_ms": lat["http_json_cert"]["p50_ms"], "p99_ms": lat["http_json_cert"]["p99_ms"]}))
    finally:
        if proc is not None:
            kill9(proc)
        site.stop()
"""


def measure(tree: Path, script: str, *args: object) -> dict[str, Any]:
    """Run ``script`` with ``tree`` first on ``sys.path`` (its own process): the JSON it printed last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    p = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"a measurement in {tree} failed: {p.stderr[-2000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def run(quick: bool, base: str) -> dict[str, Any]:
    rounds = 1 if quick else 2
    n, per = (100, 10) if quick else (300, 10)
    out: dict[str, Any] = run_header("budget", quick, base=base, rounds=rounds, agents=n, states_per_agent=per)
    with tempfile.TemporaryDirectory(prefix="fogline-budget-base-") as d:
        base_tree = Path(d) / "tree"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(base_tree), base],
                       check=True, capture_output=True)
        try:
            trees = {"this": HERE, "base": base_tree}
            rates: dict[str, list[float]] = {k: [] for k in trees}
            cpu: dict[str, list[float]] = {k: [] for k in trees}
            p50s: dict[str, list[float]] = {k: [] for k in trees}
            for _ in range(rounds):
                for name, tree in trees.items():
                    cpu[name].append(measure(tree, CPU, n, per)["path_us_on"])
                for name, tree in trees.items():
                    rates[name].append(measure(tree, INGEST, n, per)["per_s"])
                for name, tree in trees.items():
                    p50s[name].append(measure(tree, HTTPS, 300 if quick else 1000)["p50_ms"])
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base_tree)],
                           capture_output=True)
    us = {k: min(v) for k, v in cpu.items()}
    out["ingest_cpu_us_per_advert"] = {"this": us["this"], "base": us["base"], "runs": cpu,
                                       "ratio_base_over_this": round(us["base"] / us["this"], 3)}
    med = {k: statistics.median(v) for k, v in rates.items()}
    p50 = {k: statistics.median(v) for k, v in p50s.items()}
    out["ingest_verified_per_s"] = {"this": med["this"], "base": med["base"], "runs": rates,
                                    "ratio": round(med["this"] / med["base"], 3)}
    out["https_p50_ms"] = {"this": p50["this"], "base": p50["base"], "runs": p50s,
                           "ratio_base_over_this": round(p50["base"] / p50["this"], 3)}
    out["goal_ratio_at_least_0_95"] = (out["ingest_cpu_us_per_advert"]["ratio_base_over_this"] >= 0.95
                                       and out["https_p50_ms"]["ratio_base_over_this"] >= 0.95)
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="budget_bench", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="one round each, fewer agents (~3 min)")
    ap.add_argument("--base", default="main", help="the git ref to measure against (default main)")
    args = ap.parse_args(argv)
    out = run(args.quick, args.base)
    emit("budget", out)
    i, h, c = out["ingest_verified_per_s"], out["https_p50_ms"], out["ingest_cpu_us_per_advert"]
    print(f"advert intake + verify + register {c['this']:.1f} us CPU vs {c['base']:.1f} us on {args.base} "
          f"(base/this x{c['ratio_base_over_this']}); signed advert ingest {i['this']:.0f}/s vs "
          f"{i['base']:.0f}/s (x{i['ratio']}); "
          f"HTTPS p50 {h['this']:.2f} ms vs {h['base']:.2f} ms (base/this x{h['ratio_base_over_this']})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

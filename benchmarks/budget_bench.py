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

And the quiet cost, in this tree only (one process, budgets on and off alternated, the best of
5 in thread CPU time): what the budgets add to each message when nobody floods, per input:

* a device's state advert at the fog (intake, session-MAC check, registry);
* a control request at the fog (budget, decode, Ed25519 check of the envelope);
* a release at the fog (budget, decode);
* an activation at an agent from another device (budget, relay checks: ticket and sender signatures).

Ratio off/on (1.0: free; goal >= 0.95).

Prints JSON (``out/bench/budget.json``) with the figures per tree and the ratios (goal: base/this
>= 0.95 for the ingest CPU and the p50; the wall-clock rate is reported beside, noisy on a busy host).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


QUIET = r"""
import json, sys
from benchmarks.budget_bench import quiet_cost
print(json.dumps(quiet_cost(int(sys.argv[1]), int(sys.argv[2]))))
"""


def _best(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each of ``runs`` (seconds of thread CPU per message) ``rounds`` times alternated: the best, in µs."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for k, f in runs.items():
            best[k] = min(best[k], f() * 1e6)
    return {k: round(v, 2) for k, v in best.items()}


def _ratio(us: dict[str, float]) -> dict[str, float]:
    return {**us, "ratio_off_over_on": round(us["off"] / us["on"], 3)}


def quiet_cost(n: int, rounds: int) -> dict[str, Any]:
    """Per message, budgets on (as shipped) and off, no one over budget: thread CPU (see the module doc)."""
    import time

    from benchmarks.fog_bench import _intake_cpu
    from edge_agent.gate import InboundGate
    from edge_agent.testing import FogSigner
    from fog_broker.control import ControlPlane
    from runtime import codec, relay
    from runtime.messages import Activation, ControlRequest, Hop, ModelRelease
    from runtime.mqtt import Inbound
    from runtime.security import Identity, Signer, TrustStore, Verifier
    from runtime.topics import CTL, RELEASE, Topics

    out: dict[str, Any] = {"messages": n, "rounds": rounds}
    adverts = _intake_cpu(max(n // 10, 10), 10, rounds)
    out["state_advert"] = _ratio({"on": adverts["path_us_on"], "off": adverts["path_us_off"]})

    app = Identity.generate("app-1")
    now = time.time()
    signer = Signer(app, 1)
    requests = [signer.seal_bytes(ControlRequest(f"r{i}", "status", "x/reply/app-1", b"{}"), now) for i in range(n)]
    blob = bytes(2000)
    release = codec.encode(ModelRelease("w", 1, "0" * 64, blob, bytes(64), "cloud", {}))

    def control(on: bool) -> float:
        cp = ControlPlane(None)  # type: ignore[arg-type]  # admit, decode and check use no port
        cp.set_identities({"app-1": ("app", app.public_key_bytes)})
        if not on:
            cp.share = None
        verifier = Verifier(TrustStore({"app-1": app.public_key_bytes}))
        t0, t = time.monotonic(), time.thread_time()
        for k, raw in enumerate(requests):
            if cp.admit("app-1", CTL, t0 + k * 0.05):  # 20/s: within the budget
                verifier.check(codec.decode_envelope(raw), now)
        return (time.thread_time() - t) / len(requests)

    def releases(on: bool) -> float:
        cp = ControlPlane(None)  # type: ignore[arg-type]
        cp.set_identities({"cloud": ("coordinator", app.public_key_bytes)})
        if not on:
            cp.share = None
        t0, t = time.monotonic(), time.thread_time()
        for k in range(n):
            if cp.admit("cloud", RELEASE, t0 + k * 0.2):  # 5/s: within the budget
                codec.decode(release, max_objects=4096, max_arrays=0)
        return (time.thread_time() - t) / n

    fog = FogSigner("fog-b")
    src, me = Identity.generate("dev-s"), Identity.generate("dev-m")
    keys = {"dev-s": src.public_key_bytes, "dev-m": me.public_key_bytes}
    route = (Hop("dev-s", "w", 1, 0, 0), Hop("dev-m", "w", 1, 0, 1))
    x = {"x": np.ones((1, 64), np.float32)}
    frames = [relay.seal(src, fog.ticketed(Activation(f"a{i}", "w", route, 1, "r", x, now + 600), keys))
              for i in range(n)]
    topic = Topics("default").activation("dev-m", "dev-s")

    def activations(on: bool) -> float:
        opened: list[object] = []
        gate: InboundGate

        def submit(m: Inbound) -> None:
            opened.append(gate.open_activation(m))
        gate = InboundGate("dev-m", fog.public_key, TrustStore(), Verifier(TrustStore()), max_bytes=1 << 20,
                           fog_name=lambda: "fog-b", count=lambda _: None, submit=submit)
        t0, t = time.monotonic(), time.thread_time()
        for k, raw in enumerate(frames):
            m = Inbound(topic, raw, t0 + k * 0.002)  # 500/s: within the budget
            if on:
                gate.on_activation(m)
            else:
                submit(m)
        took = time.thread_time() - t
        assert len(opened) == len(frames) and all(opened), "a frame was limited or refused in a quiet run"
        return took / len(frames)

    for name, f in (("control_request", control), ("release", releases), ("activation", activations)):
        out[name] = _ratio(_best({"on": lambda f=f: f(True), "off": lambda f=f: f(False)}, rounds))  # type: ignore[misc]
    return out


def measure(tree: Path, script: str, *args: object) -> dict[str, Any]:
    """Run ``script`` with ``tree`` first on ``sys.path`` (its own process): the JSON it printed last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    p = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"a measurement in {tree} failed: {p.stderr[-2000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def run_quiet(quick: bool) -> dict[str, Any]:
    """Only the quiet cost (this tree; budgets off is the baseline, measured in the same process)."""
    out: dict[str, Any] = run_header("budget", quick, quiet_only=True)
    out["quiet_cost_us_per_message"] = measure(HERE, QUIET, 300 if quick else 1000, 5)
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    return out


def run(quick: bool, base: str) -> dict[str, Any]:
    rounds = 1 if quick else 2
    n, per = (100, 10) if quick else (300, 10)
    out: dict[str, Any] = run_header("budget", quick, base=base, rounds=rounds, agents=n, states_per_agent=per)
    out["quiet_cost_us_per_message"] = measure(HERE, QUIET, 300 if quick else 1000, 5)
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
    ap.add_argument("--quiet-only", action="store_true",
                    help="only the quiet cost of the budgets (this tree, budgets on vs off; ~1 min)")
    args = ap.parse_args(argv)
    out = run_quiet(args.quick) if args.quiet_only else run(args.quick, args.base)
    emit("budget", out)
    q = out["quiet_cost_us_per_message"]
    print("quiet cost of the budgets, CPU per message on/off (off/on): " + "; ".join(
        f"{k} {v['on']:.1f}/{v['off']:.1f} us (x{v['ratio_off_over_on']})" for k, v in q.items()
        if isinstance(v, dict)), file=sys.stderr)
    if args.quiet_only:
        return 0
    i, h, c = out["ingest_verified_per_s"], out["https_p50_ms"], out["ingest_cpu_us_per_advert"]
    print(f"advert intake + verify + register {c['this']:.1f} us CPU vs {c['base']:.1f} us on {args.base} "
          f"(base/this x{c['ratio_base_over_this']}); signed advert ingest {i['this']:.0f}/s vs "
          f"{i['base']:.0f}/s (x{i['ratio']}); "
          f"HTTPS p50 {h['this']:.2f} ms vs {h['base']:.2f} ms (base/this x{h['ratio_base_over_this']})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

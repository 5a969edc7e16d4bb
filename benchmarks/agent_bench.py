"""Edge agent footprint: idle RSS after birth, import time, time to birth, cost of a partition.

Starts mosquitto and real agent processes (``python -m edge_agent``) on
127.0.0.1 and compares against baselines measured in the same run: a bare
``python -c "import paho.mqtt.client"`` process (RSS and import wall time)
and an empty interpreter. Targets (issue 4): idle RSS <= 60 MB, import <= 1 s.

    python -m benchmarks.agent_bench [--fleet 20] [--repeat 5]

Prints JSON and writes out/bench/agent.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._emit import emit

REPO = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
RSS_TARGET_MB = 60.0
IMPORT_TARGET_S = 1.0


def _rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / MB


def _wall_import(stmt: str, repeat: int) -> float:
    """Median wall time of a fresh interpreter running ``stmt`` (includes interpreter start)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", stmt], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _importtime(module: str) -> tuple[float, list[tuple[str, float]]]:
    """(cumulative seconds of ``module``, top imports by cumulative time) from ``-X importtime``."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=REPO, check=True,
                         capture_output=True, text=True).stderr
    rows = []
    for line in out.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        parts = line.split("|")
        try:
            cum = int(parts[1].strip()) / 1e6
        except (ValueError, IndexError):
            continue
        rows.append((parts[2].rstrip(), cum))
    total = next((c for name, c in rows if name.strip() == module), 0.0)
    top = sorted(((n.strip(), c) for n, c in rows if not n.startswith("  ") or n.strip() in (
        "numpy", "paho.mqtt.client", "cryptography", "psutil", "msgpack")), key=lambda r: -r[1])[:8]
    return total, [(n, round(c, 4)) for n, c in top]


def _idle_rss(stmt: str, settle: float = 0.5) -> float:
    proc = subprocess.Popen([sys.executable, "-c", f"{stmt}; import time; time.sleep(30)"], cwd=REPO)
    try:
        time.sleep(settle + 0.5)
        return _rss_mb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _link_inner(rate_mbit: float) -> int:
    """Inside a private network namespace with a shaped loopback: estimate the uplink as the agent does."""
    sys.path.insert(0, str(REPO))
    from edge_agent.acks import watcher
    from edge_agent.stats import LinkEstimator
    from runtime.broker import BrokerConfig, MosquittoBroker
    from runtime.mqtt import MqttClient

    with tempfile.TemporaryDirectory() as tmp:
        broker = MosquittoBroker(BrokerConfig(data_dir=Path(tmp), persistence=False)).start()
        client = MqttClient("link-bench", broker.host, broker.port)
        client.start()
        est = LinkEstimator()
        try:
            if not client.wait_connected(10):
                raise RuntimeError("no connection inside the namespace")

            def pub(n: int) -> None:
                t = time.monotonic()
                h = client.publish("bench/link", b"\0" * n, qos=1)
                watcher().track(h, n, t, est)
                h.wait(5)

            for _ in range(5):
                pub(200)
            for _ in range(8):  # activation-sized publishes, with small ones between (RTT samples)
                pub(256 * 1024)
                pub(200)
            time.sleep(0.05)
        finally:
            client.stop()
            broker.stop()
    print(json.dumps({"shaped_mbit": rate_mbit, "estimated_mbit": round((est.uplink_bps or 0) / 1e6, 2),
                      "rtt_ms": round((est.rtt_s or 0) * 1000, 2)}))
    return 0


def _link_estimate(rate_mbit: float) -> dict[str, Any]:
    """Shape a private namespace's loopback with tc tbf (needs root + unshare); never touches the host's."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
        return {"skipped": "needs root, unshare and tc"}
    script = (f"ip link set lo up && ip link set lo mtu 1500 && "
              f"tc qdisc add dev lo root tbf rate {rate_mbit}mbit burst 16kb latency 400ms && "
              f"exec {sys.executable} -m benchmarks.agent_bench --link-inner {rate_mbit}")
    try:
        # own net + pid namespaces: when the inner python (pid 1 there) ends, its mosquitto dies with it
        out = subprocess.run(["unshare", "--net", "--pid", "--fork", "--kill-child", "sh", "-c", script],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"[:200]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.agent_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", type=int, default=20, help="simulated agents in one process (0: skip)")
    ap.add_argument("--repeat", type=int, default=5, help="import-time repetitions (median)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench" / "agent.json")
    ap.add_argument("--link-mbit", type=float, default=20.0, help="shaped link for the estimate (0: skip)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, a 10-agent fleet")
    ap.add_argument("--link-inner", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.quick:
        args.repeat, args.fleet = min(args.repeat, 2), min(args.fleet, 10)
    if args.link_inner:
        return _link_inner(args.link_inner)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests" / "integration"))

    from simulations.local_site import LocalSite

    from _agent_harness import kill

    result: dict[str, Any] = {"benchmark": "agent", "python": sys.version.split()[0],
                              "cpus": os.cpu_count(), "load_avg_1m_start": round(os.getloadavg()[0], 2)}
    # ---- import time (same run baselines)
    result["import_wall_s"] = {
        "python_empty": round(_wall_import("pass", args.repeat), 4),
        "paho_baseline": round(_wall_import("import paho.mqtt.client", args.repeat), 4),
        "edge_agent": round(_wall_import("import edge_agent.agent, edge_agent.runner", args.repeat), 4),
    }
    w = result["import_wall_s"]
    w["edge_agent_minus_interpreter"] = round(w["edge_agent"] - w["python_empty"], 4)
    w["ratio_vs_paho"] = round(w["edge_agent"] / w["paho_baseline"], 2)
    runs = [_importtime("edge_agent.agent") for _ in range(args.repeat)]
    base = [_importtime("paho.mqtt.client")[0] for _ in range(args.repeat)]
    cum = statistics.median(r[0] for r in runs)
    result["importtime"] = {"edge_agent.agent_cumulative_s": round(cum, 4),
                            "paho_baseline_cumulative_s": round(statistics.median(base), 4),
                            "ratio_vs_paho": round(cum / max(statistics.median(base), 1e-9), 2),
                            "top": runs[-1][1]}
    probe = subprocess.run([sys.executable, "-c", "import edge_agent.agent, edge_agent.runner, sys; "
                            "print('onnxruntime' in sys.modules, 'onnx' in sys.modules)"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    result["idle_imports_onnxruntime"] = probe[0] == "True"
    result["idle_imports_onnx"] = probe[1] == "True"

    # ---- RSS baselines
    result["rss_mb"] = {"python_empty": round(_idle_rss("pass"), 1),
                        "paho_baseline": round(_idle_rss("import paho.mqtt.client"), 1)}

    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        # the agent as deployed: a secure site (TLS, client certificate from enrolment with a token)
        site = LocalSite(tmpd / "fog", args=["--state-interval", "1"]).start()
        procs: list[subprocess.Popen[bytes]] = []
        client = site.client()

        def alive(prefix: str) -> set[str]:
            return {d["id"] for d in client.status()["devices"] if d["alive"] and d["id"].startswith(prefix)}

        def wait(pred: Any, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                if time.monotonic() > deadline:
                    raise TimeoutError("agent bench: condition not met")
                time.sleep(0.05)
        try:
            t0 = time.monotonic()
            proc = subprocess.Popen(site.agent_argv("bench-0", tmpd / "bench-0", "--state-interval", "1",
                                                    "--threads", "1"),
                                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            procs.append(proc)
            wait(lambda: "bench-0" in alive("bench-"), 60)
            result["spawn_to_alive_s"] = round(time.monotonic() - t0, 3)  # enrolment (HTTPS) + TLS + birth
            time.sleep(1.5)  # one probe/state cycle
            rss_idle = _rss_mb(proc.pid)
            result["rss_mb"]["agent_idle"] = round(rss_idle, 1)
            result["rss_mb"]["agent_idle_ratio_vs_paho"] = round(rss_idle / result["rss_mb"]["paho_baseline"], 2)
            t1 = time.monotonic()
            client.deploy({"name": "m", "model": "zoo:mlp", "source": "bench-0", "sink": "bench-0"})
            client.wait_running("m", 60)
            result["first_deploy_s"] = round(time.monotonic() - t1, 3)  # includes importing onnxruntime
            result["first_deploy_ok"] = True
            time.sleep(0.5)
            result["rss_mb"]["agent_one_partition"] = round(_rss_mb(proc.pid), 1)
            result["rss_mb"]["onnxruntime_cost"] = round(result["rss_mb"]["agent_one_partition"] - rss_idle, 1)
            kill(proc)
            if args.fleet > 1:
                fproc = subprocess.Popen(
                    [sys.executable, "-m", "edge_agent", "--broker", site.mqtt, "--enroll", site.enroll,
                     "--simulate", "pi4", "--count", str(args.fleet), "--id-prefix", "fl-",
                     "--data-dir", str(tmpd / "fleet"), "--token", site.token(uses=args.fleet)],
                    cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                procs.append(fproc)
                t2 = time.monotonic()
                wait(lambda: len(alive("fl-")) >= args.fleet, 120)
                result["fleet"] = {"agents": args.fleet, "all_alive_s": round(time.monotonic() - t2, 3)}
                time.sleep(1.5)
                rss = _rss_mb(fproc.pid)
                result["fleet"]["rss_mb"] = round(rss, 1)
                result["fleet"]["rss_mb_per_agent"] = round((rss - result["rss_mb"]["paho_baseline"]) / args.fleet, 2)
        finally:
            for p in procs:
                kill(p)
            client.close()
            site.stop()

    if args.link_mbit:
        result["link_estimate"] = _link_estimate(args.link_mbit)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    # the import target is the module's own import (-X importtime), not interpreter start-up
    result["targets"] = {
        "rss_idle_le_60mb": result["rss_mb"]["agent_idle"] <= RSS_TARGET_MB,
        "import_le_1s": result["importtime"]["edge_agent.agent_cumulative_s"] <= IMPORT_TARGET_S,
        "onnxruntime_lazy": not result["idle_imports_onnxruntime"],
    }
    emit("agent", result, path=args.out)
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

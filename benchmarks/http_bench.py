"""HTTP inference API benchmark: the Open Inference Protocol path against the MQTT ``FogClient`` path.

Run: ``python -m benchmarks.http_bench [--quick]`` (or ``fogline bench http``). Prints JSON on stdout,
writes ``out/bench/http.json``, a human summary on stderr. Everything runs on this machine: a real
``fogline broker --http 0`` (secure: TLS, client certificates), real edge agents (subprocesses,
onnxruntime), the small ``zoo:mlp`` model. Baselines come from the same run:

* latency: sequential requests, HTTP and MQTT interleaved one by one (so both see the same load):
  ``FogClient.infer`` (MQTT: signed request, sealed result) vs HTTPS keep-alive ``http.client``
  with a client certificate (JSON tensors, and the binary tensor extension), a bearer API token,
  and ``tritonclient.http`` (Triton's own client, when installed). Reports p50/p99 per path, the
  p50 difference HTTP - MQTT (goal <= 1 ms) and the ratio.
* concurrency: the same N requests from C threads, HTTP vs MQTT: throughput and latency.
* failover: C threads stream requests at a workload with 2 replicas on separate agent processes;
  the process hosting one replica is killed with SIGKILL midway. Every request is counted: sent,
  answered correctly, failed (lost = sent - answered correctly). HTTP first, then (after the
  workload is back to 2 replicas) MQTT as the baseline.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import emit

ROOT = Path(__file__).resolve().parents[1]

# Real edge agents (edge_agent.runner.make_agent) with custom simulated profiles, one group per
# process, enrolled with a bootstrap token; as tests/integration/test_fog_e2e.py runs them.
def spawn_agents(site: Any, agents: list[dict[str, Any]], directory: Path, log: Path) -> subprocess.Popen[bytes]:
    """One process running ``agents`` (dicts: id, memory, flops, labels) against ``site`` (a LocalSite)."""
    return site.spawn_agents(agents, directory, log)  # type: ignore[no-any-return]


def kill9(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.wait(5)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(step)
    raise TimeoutError(f"timed out waiting for {what}: {last!r}")


def reference(model: str, x: np.ndarray) -> np.ndarray:
    """The monolithic model's answer (onnxruntime on the whole zoo model)."""
    import onnxruntime as ort

    from models import zoo
    s = ort.InferenceSession(zoo.build(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(s.run(None, {"x": x})[0])


class OipConnection:
    """A keep-alive HTTPS (or HTTP) connection speaking the Open Inference Protocol with ``http.client``."""

    def __init__(self, hostport: str, *, ca: str | None = None, cert: tuple[str, str] | None = None,
                 token: str | None = None) -> None:
        host, port = hostport.rsplit(":", 1)
        if ca is None:
            self.conn: http.client.HTTPConnection = http.client.HTTPConnection(host, int(port), timeout=30)
        else:
            ctx = ssl.create_default_context(cafile=ca)
            if cert is not None:
                ctx.load_cert_chain(*cert)
            self.conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def infer(self, model: str, x: np.ndarray, *, binary: bool = False, name: str = "x") -> tuple[int, Any]:
        """(status, output array or error text) of one request."""
        if binary:
            head = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                           "parameters": {"binary_data_size": x.nbytes}}],
                               "parameters": {"binary_data_output": True}}).encode()
            body = head + np.ascontiguousarray(x, "<f4").tobytes()
            hdr = {**self.headers, "Content-Type": "application/octet-stream",
                   "Inference-Header-Content-Length": str(len(head))}
        else:
            body = json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                           "data": x.ravel().tolist()}]}).encode()
            hdr = {**self.headers, "Content-Type": "application/json"}
        self.conn.request("POST", f"/v2/models/{model}/infer", body, hdr)
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            return r.status, data.decode(errors="replace")
        hl = r.getheader("Inference-Header-Content-Length")
        doc = json.loads(data[:int(hl)] if hl else data)
        out = doc["outputs"][0]
        if hl:
            arr = np.frombuffer(data[int(hl):int(hl) + out["parameters"]["binary_data_size"]], "<f4")
        else:
            arr = np.asarray(out["data"], np.float32)
        return 200, arr.reshape(out["shape"])

    def close(self) -> None:
        self.conn.close()


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _stats(xs: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(xs), "p50_ms": round(pct(xs, 0.5) * 1e3, 3), "p90_ms": round(pct(xs, 0.9) * 1e3, 3),
            "p99_ms": round(pct(xs, 0.99) * 1e3, 3), "mean_ms": round(float(np.mean(xs)) * 1e3, 3) if xs else None}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------- phases


def latency(paths: dict[str, Callable[[], object]], rounds: int, warmup: int = 30) -> dict[str, Any]:
    """Each path once per round, interleaved; per-path latency stats."""
    for _ in range(warmup):
        for f in paths.values():
            f()
    got: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for k, f in paths.items():
            t = time.perf_counter()
            f()
            got[k].append(time.perf_counter() - t)
    return {k: _stats(v) for k, v in got.items()}


def concurrent_rounds(makers: dict[str, Callable[[], Callable[[], object]]], threads: int, total: int,
                      rounds: int) -> dict[str, Any]:
    """``concurrent`` for each path, ``rounds`` times, alternating which goes first (both see the same
    load); per path the median round throughput and the latencies of all rounds."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}
    lats: dict[str, list[float]] = {k: [] for k in makers}
    clients = {k: [m() for _ in range(threads)] for k, m in makers.items()}
    for r in range(rounds):
        for k in (list(makers) if r % 2 == 0 else list(reversed(makers))):
            res = concurrent(clients[k], total)
            lats[k].extend(res.pop("latencies"))
            runs[k].append(res)
    out: dict[str, Any] = {}
    for k in makers:
        tp = sorted(x["throughput_rps"] for x in runs[k])
        out[k] = {"threads": threads, "rounds": rounds, "requests_per_round": runs[k][0]["requests"],
                  "throughput_rps_median": tp[len(tp) // 2],
                  "throughput_rps_rounds": [x["throughput_rps"] for x in runs[k]], **_stats(lats[k])}
    return out


def concurrent(clients: Sequence[Callable[[], object]], total: int) -> dict[str, Any]:
    """``total`` requests from one thread per client (each client used by its thread only)."""
    threads = len(clients)
    per = total // threads
    lat: list[float] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        f = clients[i]
        mine = []
        for _ in range(per):
            t = time.perf_counter()
            f()
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(run, range(threads)))
    wall = time.perf_counter() - t0
    return {"requests": per * threads, "wall_s": round(wall, 3), "throughput_rps": round(per * threads / wall, 1),
            "latencies": lat}


def stream_with_kill(send: Callable[[int], tuple[bool, str]], threads: int, duration_s: float,
                     kill_at_s: float, kill: Callable[[], None]) -> dict[str, Any]:
    """``threads`` loops calling ``send(thread)`` for ``duration_s``; ``kill()`` at ``kill_at_s``.
    Every request is counted: sent, answered correctly, failed (with its reasons)."""
    counts = {"sent": 0, "answered": 0, "failed": 0}
    reasons: dict[str, int] = {}
    lat: list[float] = []
    around: list[float] = []  # latencies of requests in flight at the kill
    lock = threading.Lock()
    t0 = time.monotonic()
    killed_at: list[float] = []

    def run(i: int) -> None:
        while time.monotonic() - t0 < duration_s:
            t = time.monotonic()
            ok, why = send(i)
            dt = time.monotonic() - t
            with lock:
                counts["sent"] += 1
                if ok:
                    counts["answered"] += 1
                    lat.append(dt)
                    if killed_at and t <= killed_at[0] <= t + dt:
                        around.append(dt)
                else:
                    counts["failed"] += 1
                    reasons[why[:120]] = reasons.get(why[:120], 0) + 1

    ths = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for th in ths:
        th.start()
    time.sleep(kill_at_s)
    killed_at.append(time.monotonic())
    kill()
    for th in ths:
        th.join()
    return {**counts, "lost": counts["sent"] - counts["answered"], "failure_reasons": reasons,
            "threads": threads, "in_flight_at_kill_max_ms": round(max(around) * 1e3, 1) if around else None,
            **{k: v for k, v in _stats(lat).items() if k != "n"}}


# ---------------------------------------------------------------- the run


def run(quick: bool, tmp: Path) -> dict[str, Any]:
    from fog_broker.client import FogClient
    from simulations.local_site import LocalSite

    rounds = 150 if quick else 1000
    conc_total = 1600 if quick else 4800  # over all rounds of each path
    out: dict[str, Any] = {"benchmark": "http", "quick": quick, "cpu_count": os.cpu_count(), "model": "zoo:mlp"}
    site = LocalSite(tmp / "fog", site=f"bench{os.getpid()}", log=tmp / "fog.log",
                     args=["--http", "0", "--state-interval", "1", "--summary-interval", "1"]).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        big = 50_000_000
        procs.append(spawn_agents(site, [
            {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pdc"}},
            {"id": "w0", "memory": big, "labels": {"role": "lat", "power-domain": "pd0"}}],
            tmp / "agents", tmp / "agents-base.log"))
        # three single-agent processes for the 2 replicas of mlp2: one to kill per failover run
        kills = {f"k{i}": spawn_agents(site, [{"id": f"k{i}", "memory": big,
                                               "labels": {"role": "kill", "power-domain": f"pdk{i}"}}],
                                       tmp / "agents", tmp / f"agent-k{i}.log") for i in range(3)}
        procs.extend(kills.values())
        admin = site.client()
        wait_for(lambda: {d["id"] for d in admin.status()["devices"] if d["alive"]} >= {"cam", "w0", *kills},
                 60, "agents alive")
        admin.deploy({"workloads": [
            {"name": "mlp", "model": "zoo:mlp", "source": "cam", "sink": "cam", "selectors": {"role": "lat"}},
            {"name": "mlp2", "model": "zoo:mlp", "source": "cam", "sink": "cam", "replicas": 2,
             "selectors": {"role": "kill"}}]})
        admin.wait_running("mlp", 60)
        admin.wait_running("mlp2", 60)
        http_addr = site.ready["http"]
        creds = site.credentials("admin")
        ca, cert = str(creds / "ca.pem"), (str(creds / "cert.pem"), str(creds / "key.pem"))
        app = site.issue("bench-app", "app")
        token = subprocess.run([sys.executable, "-m", "runtime.cli", "api-token", "--credentials", str(app),
                                "--ttl", "1h"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        token = str(token).strip()
        x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
        ref = reference("mlp", x)
        mq = FogClient("127.0.0.1", site.port, credentials=app)

        def check(arr: Any) -> None:
            np.testing.assert_allclose(np.asarray(arr).reshape(ref.shape), ref, rtol=1e-5, atol=1e-6)

        conns = {k: OipConnection(http_addr, ca=ca, cert=cert if k != "token" else None,
                                  token=token if k == "token" else None) for k in ("json", "binary", "token")}
        check(conns["json"].infer("mlp", x)[1])
        check(conns["binary"].infer("mlp", x, binary=True)[1])
        check(mq.infer("mlp", {"x": x})["logits"])
        paths: dict[str, Callable[[], object]] = {
            "mqtt_fogclient": lambda: mq.infer("mlp", {"x": x}),
            "http_json_cert": lambda: conns["json"].infer("mlp", x),
            "http_binary_cert": lambda: conns["binary"].infer("mlp", x, binary=True),
            "http_json_token": lambda: conns["token"].infer("mlp", x),
        }
        try:
            import tritonclient.http as tc
            tcl = tc.InferenceServerClient(http_addr, ssl=True,
                                           ssl_options={"ca_certs": ca, "certfile": cert[0], "keyfile": cert[1]})
            tin = tc.InferInput("x", [1, 64], "FP32")
            tin.set_data_from_numpy(x)
            check(tcl.infer("mlp", [tin]).as_numpy("logits"))
            paths["http_tritonclient"] = lambda: tcl.infer("mlp", [tin])
        except ImportError:
            out["tritonclient"] = "not installed"
        out["load_before"] = _load()
        lat = latency(paths, rounds)
        out["latency"] = lat
        base = lat["mqtt_fogclient"]["p50_ms"]
        out["latency_vs_mqtt"] = {k: {"p50_added_ms": round(v["p50_ms"] - base, 3),
                                      "p50_ratio": round(v["p50_ms"] / base, 3),
                                      "p99_ratio": round(v["p99_ms"] / lat["mqtt_fogclient"]["p99_ms"], 3)}
                                  for k, v in lat.items() if k != "mqtt_fogclient"}
        out["goal_http_adds_at_most_1ms_p50"] = out["latency_vs_mqtt"]["http_json_cert"]["p50_added_ms"] <= 1.0
        out["load_after_latency"] = _load()

        # concurrency: C threads, each with its own HTTP connection; MQTT: one FogClient shared (one
        # MQTT session per identity), which is how an app uses it
        threads = 8

        def make_http() -> Callable[[], object]:
            c = OipConnection(http_addr, ca=ca, cert=cert)
            return lambda: c.infer("mlp", x, binary=True)
        out["concurrent"] = concurrent_rounds({
            "http_binary_cert": make_http,
            "mqtt_fogclient": lambda: (lambda: mq.infer("mlp", {"x": x}))}, threads, conc_total // 4, 4 if quick else 6)
        out["concurrent"]["throughput_ratio"] = round(
            out["concurrent"]["http_binary_cert"]["throughput_rps_median"]
            / out["concurrent"]["mqtt_fogclient"]["throughput_rps_median"], 3)

        # failover: kill -9 the process hosting replica 0 of mlp2 midway through a stream
        def host_of_replica(rep: int) -> str:
            w = next(w for w in admin.status()["workloads"] if w["name"] == "mlp2")
            return str(next(p["device"] for r in w["placement"] if r["replica"] == rep for p in r["partitions"]))

        def victim_proc() -> tuple[str, subprocess.Popen[bytes]]:
            for rep in (0, 1):
                dev = host_of_replica(rep)
                if dev in kills and kills[dev].poll() is None:
                    return dev, kills[dev]
            raise RuntimeError("no killable replica host")

        stream_threads = 8
        duration = 3.0 if quick else 6.0
        http_conns = [OipConnection(http_addr, ca=ca, cert=cert) for _ in range(stream_threads)]

        def send_http(i: int) -> tuple[bool, str]:
            try:
                st, arr = http_conns[i].infer("mlp2", x, binary=True)
            except (OSError, http.client.HTTPException) as exc:
                return False, f"transport: {exc}"
            if st != 200:
                return False, f"{st} {arr}"
            return (True, "") if np.allclose(arr.reshape(ref.shape), ref, rtol=1e-5, atol=1e-6) else (False, "wrong")

        def retries() -> int:
            return int(admin.status(limit=0)["counters"].get("router.retries", 0))

        def failover(send: Callable[[int], tuple[bool, str]]) -> dict[str, Any]:
            """Stream through ``send`` and kill -9 a replica's agent a third of the way in."""
            dev, proc = victim_proc()
            before = retries()
            res = stream_with_kill(send, stream_threads, duration, duration / 3, lambda: kill9(proc))
            return {**res, "killed": dev, "router_failovers": retries() - before}

        out["failover_http"] = failover(send_http)
        # the lost replica is re-placed on the third agent; then the same again over MQTT
        wait_for(lambda: next(w for w in admin.status()["workloads"] if w["name"] == "mlp2")["healthy_replicas"] == 2,
                 60, "mlp2 back to 2 replicas")

        def send_mqtt(i: int) -> tuple[bool, str]:
            try:
                arr = mq.infer("mlp2", {"x": x}, timeout=5.0)["logits"]
            except Exception as exc:  # noqa: BLE001 - counted, with its reason
                return False, f"{type(exc).__name__}: {exc}"
            return (True, "") if np.allclose(arr, ref, rtol=1e-5, atol=1e-6) else (False, "wrong")

        out["failover_mqtt_baseline"] = failover(send_mqtt)
        st = admin.status()
        out["router_counters"] = {k: v for k, v in st["counters"].items() if k.startswith("router.")}
        out["load_end"] = _load()
        mq.close()
        admin.close()
    finally:
        for p in procs:
            kill9(p)
        site.stop()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="http_bench")
    ap.add_argument("--quick", action="store_true", help="smaller run (~40 s)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fogline-http-bench-") as d:
        out = run(args.quick, Path(d))
    emit("http", out)
    lat = out["latency"]
    print(f"p50 MQTT {lat['mqtt_fogclient']['p50_ms']} ms, HTTP JSON {lat['http_json_cert']['p50_ms']} ms "
          f"(added {out['latency_vs_mqtt']['http_json_cert']['p50_added_ms']} ms), binary "
          f"{lat['http_binary_cert']['p50_ms']} ms; failover lost HTTP {out['failover_http']['lost']} / "
          f"MQTT {out['failover_mqtt_baseline']['lost']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End to end on 127.0.0.1: mosquitto, the fog broker, real edge agent subprocesses.

Scenarios: deploy + infer; kill -9 of an agent hosting a partition (re-placed,
inference continues, a replicated workload fails over at once); quota,
priority and preemption; kill -9 and restart of the fog broker (nothing
healthy redeployed); the CLI (deploy, status, infer).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.broker import find_mosquitto, free_port
from simulations.local_site import LocalSite

from waiting import wait_for

# Waits are bounds on "eventually", generous for a loaded 2-core machine shared with another
# xdist worker (a fog's first status answer took over 10 s there); the checks are the states and
# reasons reached, never how fast. A passing run waits no longer for them.
SETTLE_S = 60.0
MOVE_COUNTERS = ("deploys_sent", "undeploys_sent", "orphans", "repairs", "repair_fallbacks", "retries")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

class Procs:
    """Subprocesses of one test (the fog brokers and agent groups), killed in teardown whatever happens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sites: list[LocalSite] = []

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.tmp / f"{name}.log", "ab") as log:  # the child keeps its own copy
            p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def agents(self, site: LocalSite, agents: list[dict[str, Any]], name: str) -> subprocess.Popen[bytes]:
        """Simulated agents with custom profiles (tiny memories make placement pressure with zoo models)."""
        p = site.spawn_agents(agents, self.tmp / "agents", self.tmp / f"{name}.log")
        self.procs.append(p)
        return p

    def fog(self, data_dir: Path, site: str, *, port: int | None = None, name: str = "fog",
            startup_wait_s: float = 4.0) -> LocalSite:
        """``fogline broker`` as the README starts it (secure, owns its mosquitto)."""
        s = LocalSite(data_dir, site=site, port=port, log=self.tmp / f"{name}.log", verbose=2,
                      args=["--state-interval", "1", "--startup-wait", str(startup_wait_s),
                            "--summary-interval", "1"]).start()
        self.sites.append(s)
        return s

    def kill_all(self) -> None:
        for s in self.sites:
            s.kill()
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait(5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    pr = Procs(tmp_path)
    try:
        yield pr
    finally:
        pr.kill_all()


def _site() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _alive(c: Any) -> set[str]:
    return {d["id"] for d in c.status()["devices"] if d["alive"]}


def _workload(c: Any, name: str) -> dict[str, Any]:
    return next(w for w in c.status()["workloads"] if w["name"] == name)


def _reference(model: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from models import zoo
    s = ort.InferenceSession(zoo.build(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _worker(i: int, memory: int, flops: float = 5e9) -> dict[str, Any]:
    return {"id": f"w{i}", "memory": memory, "flops": flops,
            "labels": {"role": "worker", "power-domain": f"pd{i}"}}


CAM = {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pd-cam"}}


def test_deploy_infer_kill9_agent_replaced_and_replica_failover(procs: Procs, tmp_path: Path) -> None:
    fog = procs.fog(tmp_path / "fog", _site())
    # 6 agents: cam + w3 + w4 (spares, not workers) in one process, w0..w2 in their own (kill -9 targets)
    spares = [CAM, {**_worker(3, 400_000), "labels": {"role": "spare", "power-domain": "pd3"}},
              {**_worker(4, 400_000), "labels": {"role": "spare", "power-domain": "pd4"}}]
    procs.agents(fog, spares, "agents-spare")
    workers = {f"w{i}": procs.agents(fog, [_worker(i, 400_000)], f"agent-w{i}") for i in range(3)}
    c = fog.client()
    wait_for(lambda: _alive(c) >= {"cam", "w0", "w1", "w2", "w3", "w4"}, SETTLE_S, "6 agents alive")
    res = c.deploy({"workloads": [
        {"name": "res", "model": "zoo:resnet", "source": "cam", "sink": "cam", "selectors": {"role": "worker"}},
        {"name": "mlp2", "model": "zoo:mlp", "source": "cam", "sink": "cam", "replicas": 2,
         "selectors": {"role": "worker"}},
    ]})
    assert [d["name"] for d in res["deployed"]] == ["res", "mlp2"]
    w = c.wait_running("res", SETTLE_S)
    c.wait_running("mlp2", SETTLE_S)
    devices = [p["device"] for r in w["placement"] for p in r["partitions"]]
    assert len(devices) >= 2, w  # 513 KB of resnet on 400 KB devices: a chain of partitions
    # each agent timed its partition at load; the fog now places by those measured times
    calibrated = wait_for(lambda: set(_workload(c, "res")["measured_on"]), SETTLE_S, "calibrated devices")
    assert set(devices) <= calibrated
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    out = c.infer("res", {"x": x}, timeout=30)
    np.testing.assert_allclose(out["logits"], _reference("resnet", x), rtol=1e-4, atol=1e-5)
    xm = np.random.default_rng(1).random((1, 64), dtype=np.float32)
    ref_m = _reference("mlp", xm)

    victim = devices[0]
    keep = {(p["index"], p["device"]) for r in w["placement"] for p in r["partitions"] if p["device"] != victim}
    t_kill = time.monotonic()
    os.killpg(workers[victim].pid, signal.SIGKILL)
    # The replicated workload keeps answering (a replica chain without the victim serves at once).
    out_m = c.infer("mlp2", {"x": xm}, timeout=5)
    np.testing.assert_allclose(next(iter(out_m.values())), ref_m, rtol=1e-4, atol=1e-5)

    def replaced() -> Any:
        w2 = _workload(c, "res")
        devs = [p["device"] for r in w2["placement"] for p in r["partitions"]]
        return w2 if w2["healthy_replicas"] == 1 and victim not in devs else None
    w2 = wait_for(replaced, SETTLE_S, "res re-placed")
    recovery = time.monotonic() - t_kill
    still = {(p["index"], p["device"]) for r in w2["placement"] for p in r["partitions"]}
    assert keep <= still, "healthy partitions must stay where they were"
    out = c.infer("res", {"x": x}, timeout=30)
    np.testing.assert_allclose(out["logits"], _reference("resnet", x), rtol=1e-4, atol=1e-5)
    wait_for(lambda: _workload(c, "mlp2")["healthy_replicas"] == 2, SETTLE_S, "mlp2 back to 2 replicas")
    st = c.status()
    dead = next(d for d in st["devices"] if d["id"] == victim)
    assert not dead["alive"] and dead["lost_reason"] == "will"
    print(f"\nkill -9 -> re-placed and running (observed by polling): {recovery:.3f} s; "
          f"controller recoveries {st['recoveries_s']}")
    assert max(st["recoveries_s"]) < 2.0
    c.close()


def test_quota_priority_and_preemption(procs: Procs, tmp_path: Path) -> None:
    fog = procs.fog(tmp_path / "fog", _site())
    # two workers that each hold one resnet (513 KB) but not two
    procs.agents(fog, [CAM, _worker(0, 700_000), _worker(1, 700_000)], "agents")
    c = fog.client()
    wait_for(lambda: _alive(c) >= {"cam", "w0", "w1"}, SETTLE_S, "agents alive")
    base = {"model": "zoo:resnet", "source": "cam", "sink": "cam", "selectors": {"role": "worker"}}
    # quota: tenant q may use 100 KB -> pending with the quota reason
    c.deploy({"workloads": [{**base, "name": "over-quota", "tenant": "q"}], "quotas": {"q": {"memory_bytes": 100_000}}})
    w = wait_for(lambda: (x := _workload(c, "over-quota"))["reasons"] and x, SETTLE_S, "quota reason")
    assert w["status"] == "pending" and "quota" in w["reasons"], w
    with pytest.raises(Exception, match="no running replica"):
        c.infer("over-quota", {"x": np.zeros((1, 3, 32, 32), np.float32)}, timeout=3)
    # low priority takes both workers (2 replicas, anti-affinity)
    c.deploy({**base, "name": "low", "priority": 0, "replicas": 2})
    c.wait_running("low", SETTLE_S)
    # high priority needs one worker: preempts low, which cannot fit any more
    c.deploy({**base, "name": "high", "priority": 10})
    c.wait_running("high", SETTLE_S)
    low = wait_for(lambda: (x := _workload(c, "low"))["status"] == "pending" and x, SETTLE_S,
                   "low preempted")
    assert "preempted" in low["reasons"] and low["evicted"], low
    x = np.random.default_rng(2).random((1, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(c.infer("high", {"x": x}, timeout=30)["logits"], _reference("resnet", x),
                               rtol=1e-4, atol=1e-5)
    # the evicted partitions are gone from the devices
    wait_for(lambda: not any("low/" in p for d in c.status()["devices"] for p in d["partitions"]),
             SETTLE_S, "low undeployed")
    # deleting high lets low back in
    c.delete("high")
    c.wait_running("low", SETTLE_S)
    c.close()


def test_fog_restart_redeploys_nothing_healthy_and_cli(procs: Procs, tmp_path: Path) -> None:
    site = _site()
    port = free_port()
    data = tmp_path / "fog"
    fog = procs.fog(data, site, port=port)  # owns mosquitto
    procs.agents(fog, [CAM, _worker(0, 400_000), _worker(1, 400_000), _worker(2, 400_000)], "agents")
    c = fog.client()
    wait_for(lambda: _alive(c) >= {"cam", "w0", "w1", "w2"}, SETTLE_S, "agents alive")
    # CLI deploy (one workload file), status --json, infer
    wl = tmp_path / "workload.json"
    wl.write_text(json.dumps({"name": "res", "model": "zoo:resnet", "source": "cam", "sink": "cam",
                              "replicas": 1, "selectors": {"role": "worker"}}))
    # the CLI gets its own identity: one MQTT session (and one request sequence) per identity
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FOGLINE_CREDENTIALS": str(fog.issue("cli"))}
    cli = [PY, "-m", "runtime.cli"]
    r = subprocess.run(cli + ["deploy", str(wl), "--broker", f"127.0.0.1:{port}", "--wait", "30"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "running" in r.stdout
    x = np.random.default_rng(3).random((1, 3, 32, 32), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run(cli + ["infer", "res", str(tmp_path / "x.npy"), "--broker", f"127.0.0.1:{port}",
                              "--json", "--timeout", "10"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.array(json.loads(r.stdout)["outputs"]["logits"], dtype=np.float32),
                               _reference("resnet", x), rtol=1e-4, atol=1e-5)

    # where the partitions are when the fog dies, once the fleet holds exactly its placement (not
    # when the deploy ran: on a loaded machine the fog may move a stage it measured slow in between,
    # and a fog killed in the middle of a move leaves a copy for the next one to undeploy)
    def quiet() -> Any:
        st = c.status()
        w = next(x for x in st["workloads"] if x["name"] == "res")
        placed = sorted(p["device"] for rep in w["placement"] for p in rep["partitions"])
        held = sorted(d["id"] for d in st["devices"] for p in d["partitions"] if p.startswith("res/"))
        return w if w["healthy_replicas"] == 1 and held == placed else None
    before = wait_for(quiet, SETTLE_S, "res running on exactly its placement")
    before_parts = sorted((p["index"], p["device"]) for rep in before["placement"] for p in rep["partitions"])
    mosquitto = json.loads((data / "mqtt" / "owner.json").read_text())["pid"]
    fog.kill_fog_only()  # a fog crash: its mosquitto must not outlive it (no orphan holds the port)
    wait_for(lambda: not Path(f"/proc/{mosquitto}").exists() or
             Path(f"/proc/{mosquitto}/stat").read_text().split()[2] == "Z", SETTLE_S, "mosquitto gone with its fog")
    # a new mosquitto; agents reconnect, partitions stay. The restarted fog re-places the partitions
    # of a device not heard from within its startup wait: 4 s lost a slow agent's reconnect under a
    # load of 36 on two workers (w2's partition moved), so this fog waits longer
    fog2 = procs.fog(data, site, port=port, name="fog2", startup_wait_s=20.0)

    def settled() -> Any:
        st = c.status()
        w = next((x for x in st["workloads"] if x["name"] == "res"), None)
        return st if st["ready"] and st["epoch"] == 2 and w and w["healthy_replicas"] == 1 else None
    try:
        st = wait_for(settled, SETTLE_S, "restarted fog ready with res running")
    except Exception:
        assert fog2.proc is not None
        os.kill(fog2.proc.pid, signal.SIGUSR1)
        time.sleep(1)
        raise
    after = next(x for x in st["workloads"] if x["name"] == "res")
    after_parts = sorted((p["index"], p["device"]) for rep in after["placement"] for p in rep["partitions"])
    assert after_parts == before_parts
    counters = st["counters"]
    moves = {k: v for k, v in counters.items() if v and k.rsplit(".", 1)[-1] in MOVE_COUNTERS}
    assert counters.get("deploys_sent", 0) == 0, moves
    # An undeploy is allowed only for an orphan: a copy the fleet reports outside the stored placement
    # (e.g. a move the killed fog had begun). One undeploy was seen once on two xdist workers at a
    # load of 20, its cause not found: ``moves`` names it next time. A healthy placed partition is
    # never undeployed: the placement is the same, nothing was repaired, and the fleet holds it.
    assert counters.get("undeploys_sent", 0) == counters.get("controller.orphans", 0), moves
    assert counters.get("controller.repairs", 0) == 0, moves
    assert wait_for(quiet, SETTLE_S, "res running on exactly its placement after the restart")
    np.testing.assert_allclose(c.infer("res", {"x": x}, timeout=30)["logits"], _reference("resnet", x),
                               rtol=1e-4, atol=1e-5)
    r = subprocess.run(cli + ["status"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "res" in r.stdout and "running" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cli + ["status", "--broker", f"127.0.0.1:{port}", "--json"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    doc = json.loads(r.stdout)
    assert {d["id"] for d in doc["devices"] if d["alive"]} >= {"cam", "w0", "w1", "w2"}
    c.close()


def test_hung_agent_is_declared_dead_by_the_state_deadline(procs: Procs, tmp_path: Path) -> None:
    """SIGSTOP: no Will for ~1.5 x keepalive, but 3 missed state intervals (1 s here) declare it dead."""
    fog = procs.fog(tmp_path / "fog", _site())
    hung = procs.agents(fog, [_worker(0, 400_000)], "agent-hung")
    procs.agents(fog, [CAM], "agent-cam")
    c = fog.client()
    wait_for(lambda: _alive(c) >= {"cam", "w0"}, SETTLE_S, "agents alive")
    t0 = time.monotonic()
    os.killpg(hung.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "w0" not in _alive(c), 30, "w0 declared dead")
        took = time.monotonic() - t0
        dev = next(d for d in c.status()["devices"] if d["id"] == "w0")
        assert dev["lost_reason"] == "missed state adverts", dev
        print(f"hung agent declared dead after {took:.2f} s")  # the reason above, not a timing, is the check
    finally:
        os.killpg(hung.pid, signal.SIGCONT)
    wait_for(lambda: "w0" in _alive(c), SETTLE_S, "w0 back after SIGCONT (rebirth)")
    c.close()

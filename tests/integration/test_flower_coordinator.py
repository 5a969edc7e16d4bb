"""Real Flower: `fogline coordinator --app` with authenticated SuperNodes, on 127.0.0.1.

* the digits example (numpy): one Byzantine client, a kill -9 of the whole coordinator
  (supervisor, SuperLink, ServerApp) mid-run, resume from the checkpoints to the same
  rounds, signed releases whose ONNX predicts what the numpy model predicts;
* the PyTorch example (a CNN written the way ``flwr new`` writes an app, with
  ``torch.onnx.export`` as its export hook): one Byzantine client, the release published
  over TLS to a real fog site (``fogline broker``) that pins the coordinator's key, rolled
  out as a ``release:`` workload on two enrolled agents, and the fog's answers equal torch's
  predictions on the held-out digits.
Every wait is bounded; every process is killed in teardown.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))

from cloud_coordinator.app import bundled_app
from cloud_coordinator.release import read_release
from cloud_coordinator.settings import key_path
from cloud_coordinator.store import CheckpointStore
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, Identity, verify_artifact

from _coordinator import Deployment, kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]
N = 4


def _verify(rel: ModelRelease, key: bytes) -> None:
    verify_artifact(key, rel.artifact, ArtifactSignature(rel.sha256, rel.signer, rel.signature, dict(rel.metadata)))


def _onnx_predict(blob: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.array([int(np.argmax(sess.run(None, {name: x[i:i + 1]})[0])) for i in range(len(x))])


@pytest.mark.timeout(480)  # its own waits add up to 380 s (60 + 120 + 200): pytest's 300 s cut it short
def test_digits_app_kill9_resume_and_release(tmp_path: Path) -> None:
    dep = Deployment(tmp_path)
    try:
        keys = [dep.authorize(f"dev-{i}") for i in range(N)]
        args = ("--app", str(bundled_app("digits")), "--replica-dir", str(tmp_path / "replica"), "--rounds", "3",
                "--rule", "trimmed_mean", "--f", "1", "--num-partitions", str(N), "--round-timeout", "40",
                "--grace", "2", "--timeout", "200", "--seed", "7")
        coord = dep.coordinator(*args)
        dep.wait_file(dep.ck / "superlink.json", 60)
        for i in range(N):
            attack = " byzantine='sign-flip'" if i == N - 1 else ""
            dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={N}{attack}")
        dep.wait_file(dep.ck / "ckpt-00000001.json", 120)
        time.sleep(1.0)  # round 2 in flight
        kill_tree(coord)  # kill -9: supervisor, SuperLink, flwr run and the ServerApp
        assert not (dep.ck / "report.json").exists()
        t0 = time.monotonic()
        again = dep.coordinator(*args, log_name="coordinator-2")
        assert dep.wait_exit(again, 200, "coordinator-2") == 0, (tmp_path / "coordinator-2.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        assert rep["resumed_from"] >= 1 and rep["rounds_done"] == 3
        assert [h["round"] for h in rep["history"]] == [1, 2, 3]
        assert all(h["clients"] == [f"dev-{i}" for i in range(N)] for h in rep["history"])
        assert rep["history"][-1]["server"]["accuracy"] > 0.8
        trusted = Identity.load("coordinator", key_path(dep.ck, "coordinator.key")).public_key_bytes
        ck, _ = CheckpointStore([dep.ck, tmp_path / "replica"], trusted_key=trusted).load_latest()
        assert ck is not None and ck.server_round == 3
        rel = read_release(Path(rep["releases"][-1]["path"]))
        _verify(rel, Identity.load("coordinator", key_path(dep.ck, "coordinator.key")).public_key_bytes)
        from models.digits import load_digits_split
        from models.train import SoftmaxRegression

        model = SoftmaxRegression()
        model.set_weights(list(ck.weights))
        x = load_digits_split(N, seed=7).test[0][:60].astype(np.float32)
        assert np.array_equal(_onnx_predict(rel.artifact, x), model.predict(x))
        print(f"\nresumed after round {rep['resumed_from']} in {time.monotonic() - t0:.1f} s; "
              f"rounds {[round(s, 1) for s in rep['round_s']]} s")
    finally:
        dep.close()


def test_pytorch_app_release_is_served_by_the_fog_like_torch(tmp_path: Path) -> None:
    """Train the CNN robustly, release it over TLS to a real fog site, serve it on two agents, compare with torch."""
    torch = pytest.importorskip("torch")
    local_site = pytest.importorskip("simulations.local_site")
    import subprocess

    from runtime.credentials import load_credentials

    site = local_site.LocalSite(tmp_path / "fog", site="lab", args=["--summary-interval", "2"]).start()
    dep = Deployment(tmp_path)
    agents: list[subprocess.Popen[bytes]] = []
    client = None
    try:
        token = site.token(uses=2)
        for i in range(2):
            agents.append(subprocess.Popen(
                site.agent_argv(f"edge-{i}", tmp_path / f"agent-{i}", "--simulate", "x86-gateway", "--state-interval",
                                "1", token=token), stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"agent-{i}.log", "wb"), start_new_session=True))  # noqa: SIM115
        creds = load_credentials(site.issue("coord-lab", role="coordinator"))
        n = 5  # multi_krum with f=1 needs 2f + 3
        keys = [dep.authorize(f"pi-{i}") for i in range(n)]
        app = Path(__file__).resolve().parents[2] / "examples" / "pytorch"
        coord = dep.coordinator("--app", str(app), "--rounds", "2", "--rule", "multi_krum", "--f", "1",
                                "--round-timeout", "90", "--grace", "2", "--timeout", "400",
                                "--run-config", "fraction-evaluate=0.0",
                                "--mqtt", site.mqtt, "--credentials", str(creds.dir))
        dep.wait_file(dep.ck / "superlink.json", 60)
        for i in range(n):
            attack = " byzantine='gaussian'" if i == 0 else ""
            dep.node(f"pi-{i}", keys[i], f"partition-id={i} num-partitions={n}{attack}")
        assert dep.wait_exit(coord, 400) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        assert all(h["rejected"].get("pi-0") == "not selected" for h in rep["history"])  # the Byzantine CNN
        assert rep["history"][-1]["server"]["accuracy"] > 0.7
        assert [r["version"] for r in rep["releases"]] == [1, 2]
        published = json.loads((dep.ck / "releases" / "published.json").read_text())
        assert sorted(v["version"] for v in published.values()) == [1, 2]
        client = site.client()

        def ready() -> dict | None:  # type: ignore[type-arg]
            st = client.status()
            rel = (st.get("releases") or {}).get("digits-cnn")
            alive = sum(d["alive"] for d in st["devices"])
            return rel if rel and rel["version"] == 2 and alive >= 2 else None

        rel = wait_for(ready, 60, lambda: f"release v2 and two devices alive: {client.status()}",
                       interval=0.5)
        assert rel["signer"] == "coord-lab"
        client.deploy({"name": "cnn", "tenant": "t", "priority": 5, "replicas": 1, "objective": "latency",
                       "source": "edge-0", "sink": "edge-1", "selectors": {}, "tolerations": [],
                       "model": "release:digits-cnn"})
        client.wait_running("cnn", timeout=60)
        from _pytorch_example import Net, load_centralized_dataset  # type: ignore[import-not-found]

        ck, _ = CheckpointStore([dep.ck]).load_latest()
        assert ck is not None and ck.server_round == 2
        net = Net()
        net.load_state_dict({nm: torch.from_numpy(np.asarray(w)) for nm, w in zip(ck.names, ck.weights)})
        net.eval()
        x = next(iter(load_centralized_dataset()))[0][:30]
        with torch.no_grad():
            want = net(x).argmax(dim=1).numpy()
        got = [int(np.argmax(next(iter(client.infer("cnn", {"x": x[i:i + 1].numpy()}, timeout=5.0).values()))))
               for i in range(len(x))]
        assert np.array_equal(np.array(got), want)
    finally:
        if client is not None:
            client.close()
        for a in agents:
            kill_tree(a)
        dep.close()
        site.stop()

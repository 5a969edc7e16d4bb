"""Real Flower: SuperLink + 3 SuperNodes + `fogline coordinator`, on 127.0.0.1.

One uninterrupted reference run, then the same run killed mid-round twice
over (kill -9 of the whole coordinator; kill -9 of the SuperLink only). Both
resume from the checkpoints, repeat at most the in-flight round, and end with
the reference model. Every wait is bounded; every process is killed in teardown.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from runtime.broker import free_port, port_open
from cloud_coordinator.release import KEY_FILE
from cloud_coordinator.store import CheckpointStore
from runtime import codec
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, Identity, verify_artifact

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VENV_BIN = Path(sys.executable).parent
N_NODES = 4  # dev-3 is Byzantine (sign-flip); trimmed_mean with f=1 must shrug it off
ROUNDS = 2

@pytest.fixture(scope="module")
def flower_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flower")
    env = dict(os.environ)
    env.update({"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1", "FOGLINE_CACHE_DIR": str(root / "cache"),
                "PYTHONUNBUFFERED": "1"})
    return env


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Deployment:
    """SuperNodes on a fresh port; coordinators started in their own session (killable as a tree)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start_nodes(self) -> None:
        for i in range(N_NODES):
            log = open(self.root / f"supernode-{i}.log", "wb")  # noqa: SIM115
            env = {**self.env, "FLWR_HOME": str(self.root / f"node-{i}")}
            attack = " byzantine='sign-flip'" if i == N_NODES - 1 else ""
            self.procs.append(subprocess.Popen(
                [str(VENV_BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                 "--port", str(free_port()), "--node-config",
                 f"device-id='dev-{i}' partition-id={i} num-partitions={N_NODES}{attack}"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
            log.close()

    def coordinator(self, ckpt: Path, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.root / f"coordinator-{ckpt.name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(VENV_BIN / "fogline"), "-v", "coordinator", "--rounds", str(ROUNDS), "--rule", "trimmed_mean",
             "--f", "1", "--seed", "7", "--checkpoint-dir", str(ckpt), "--replica-dir", str(ckpt) + "-replica",
             "--superlink", f"127.0.0.1:{self.port}", "--min-clients", str(N_NODES), "--round-timeout", "60",
             "--num-partitions", str(N_NODES), "--timeout", "150",
             "--release-every", str(ROUNDS), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            _kill_tree(p)


@pytest.fixture
def deployment(tmp_path: Path, flower_env: dict[str, str]) -> Iterator[Deployment]:
    dep = Deployment(tmp_path, flower_env)
    dep.start_nodes()
    try:
        yield dep
    finally:
        dep.close()


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float, logf: Path) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail(f"coordinator did not finish in {timeout_s} s:\n{logf.read_text()[-3000:]}")


def _wait_for(path: Path, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{path.name} did not appear within {timeout_s} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def _final(ckpt: Path) -> tuple[int, tuple[np.ndarray, ...]]:
    got, _ = CheckpointStore([ckpt, Path(str(ckpt) + "-replica")]).load_latest()
    assert got is not None
    return got.server_round, got.weights


REFERENCE: dict[str, object] = {}


def _reference(dep: Deployment) -> tuple[np.ndarray, ...]:
    if "weights" not in REFERENCE:
        ck = dep.root / "reference"
        t0 = time.monotonic()
        rc = _wait_exit(dep.coordinator(ck), 170, dep.root / "coordinator-reference.log")
        assert rc == 0, (dep.root / "coordinator-reference.log").read_text()[-3000:]
        REFERENCE["wall_s"] = time.monotonic() - t0
        REFERENCE["report"] = json.loads((ck / "report.json").read_text())
        REFERENCE["weights"] = _final(ck)[1]
    return REFERENCE["weights"]  # type: ignore[return-value]


def test_rounds_run_with_robust_rule_and_quorum_replication(deployment: Deployment) -> None:
    _reference(deployment)
    rep = REFERENCE["report"]
    assert isinstance(rep, dict)
    assert rep["rounds_done"] == ROUNDS and rep["resumed_from"] == 0
    assert [h["round"] for h in rep["history"]] == list(range(1, ROUNDS + 1))
    assert all(h["clients"] == [f"dev-{i}" for i in range(N_NODES)] for h in rep["history"])
    assert rep["history"][-1]["accuracy"] > 0.8
    rel = rep["releases"][-1]
    assert rel["version"] == ROUNDS and not rel["published"]
    frame = codec.decode(Path(rel["path"]).read_bytes())
    assert isinstance(frame, ModelRelease) and frame.metadata["round"] == str(ROUNDS)
    key = Identity.load("coordinator", deployment.root / "reference" / KEY_FILE).public_key_bytes
    verify_artifact(key, frame.artifact, ArtifactSignature(frame.sha256, frame.signer, frame.signature,
                                                           dict(frame.metadata)))
    for d in ("reference", "reference-replica"):
        assert sorted(p.name for p in (deployment.root / d).glob("ckpt-*.json")) == [
            f"ckpt-{r:08d}.json" for r in range(1, ROUNDS + 1)]
    print(f"\nreference: wall {REFERENCE['wall_s']:.1f} s, rounds {[round(s, 1) for s in rep['round_s']]} s, "
          f"checkpoint {[round(s * 1000, 1) for s in rep['checkpoint_s']]} ms")


def test_kill_coordinator_mid_round_resumes_to_same_model(deployment: Deployment) -> None:
    ck = deployment.root / "killed"
    proc = deployment.coordinator(ck)
    _wait_for(ck / "ckpt-00000001.json", 120)
    time.sleep(2.0)  # round 2 in flight
    _kill_tree(proc)  # kill -9 of coordinator, its SuperLink and the ServerApp
    assert not (ck / "report.json").exists()
    t0 = time.monotonic()
    rc = _wait_exit(deployment.coordinator(ck), 170, deployment.root / "coordinator-killed.log")
    assert rc == 0
    rep = json.loads((ck / "report.json").read_text())
    assert rep["resumed_from"] >= 1 and rep["rounds_done"] == ROUNDS
    rnd, weights = _final(ck)
    assert rnd == ROUNDS
    for a, b in zip(weights, _reference(deployment), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    print(f"\nresumed after round {rep['resumed_from']}: resume {rep['resume_s'] * 1000:.1f} ms, "
          f"restart-to-done {time.monotonic() - t0:.1f} s")


def test_kill_superlink_mid_round_resumes_to_same_model(deployment: Deployment) -> None:
    ck = deployment.root / "superlink"
    proc = deployment.coordinator(ck)
    _wait_for(ck / "ckpt-00000001.json", 120)
    time.sleep(2.0)
    links = [c for c in psutil.Process(proc.pid).children(recursive=True) if "flower-superlink" in " ".join(
        c.cmdline())]
    assert len(links) == 1
    links[0].kill()
    rc = _wait_exit(proc, 170, deployment.root / "coordinator-superlink.log")
    assert rc == 0
    log = (deployment.root / "coordinator-superlink.log").read_text()
    assert "SuperLink died mid-run" in log
    rep = json.loads((ck / "report.json").read_text())
    assert rep["resumed_from"] >= 1
    _, weights = _final(ck)
    for a, b in zip(weights, _reference(deployment), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert port_open("127.0.0.1", deployment.port) is False  # the coordinator stopped its SuperLink

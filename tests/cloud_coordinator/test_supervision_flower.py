"""The supervisor against a real SuperLink: key registration is idempotent across SuperLink restarts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_coordinator.app import bundled_app
from cloud_coordinator.launcher import Supervisor, SupervisorOptions
from cloud_coordinator.registration import LEDGER_FILE
from cloud_coordinator.supernodes import SUPERNODES_FILE, KeyBook, keygen
from runtime.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


class CountingSupervisor(Supervisor):
    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.calls: list[list[str]] = []

    def flwr(self, argv: list[str], timeout_s: float) -> tuple[int | None, str]:
        self.calls.append(argv[:2])
        return super().flwr(argv, timeout_s)


def test_registration_skips_keys_flower_knows_and_restarts_keep_them(tmp_path: Path) -> None:
    work = tmp_path / "ck"
    for i in range(3):
        _, pub = keygen(tmp_path / f"k{i}")
        KeyBook(work / SUPERNODES_FILE).add(f"dev-{i}", pub.read_bytes())
    opts = SupervisorOptions(work, bundled_app("digits"), work / "settings.json", f"127.0.0.1:{free_port()}")
    first = CountingSupervisor(opts)
    try:
        first.ensure_superlink()
    finally:
        first.close()
    assert first.calls.count(["supernode", "register"]) == 3
    ledger = json.loads((work / LEDGER_FILE).read_text())
    assert len(ledger) == 3 and all(ledger.values())
    assert json.loads((work / "superlink.json").read_text())["registered"] == ["dev-0", "dev-1", "dev-2"]
    again = CountingSupervisor(opts)  # the same database: Flower still lists the three nodes
    try:
        again.ensure_superlink()
    finally:
        again.close()
    assert again.calls == [["supernode", "list"]]


def _cmdline(p: object) -> list[str]:
    import psutil

    try:
        return list(p.cmdline())  # type: ignore[attr-defined]
    except psutil.Error:  # exited meanwhile, or a zombie
        return []


def _locked(path: Path) -> bool:
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_kill9_of_the_coordinator_takes_superlink_superexec_and_serverapp_and_frees_the_lock(tmp_path: Path) -> None:
    """Only the coordinator's pid gets SIGKILL (not its process group): everything it started must follow."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from cloud_coordinator.runfiles import LOCK_FILE

    work = tmp_path / "ck"
    _, pub = keygen(tmp_path / "k0")
    KeyBook(work / SUPERNODES_FILE).add("dev-0", pub.read_bytes())
    with open(tmp_path / "coordinator.log", "wb") as log:
        coord = subprocess.Popen([str(Path(sys.executable).parent / "fogline"), "-v", "coordinator",
                                  "--checkpoint-dir", str(work), "--superlink", f"127.0.0.1:{free_port()}",
                                  "--rounds", "1", "--round-timeout", "120", "--timeout", "200"],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while True:  # the ServerApp runs (it holds the work directory's lock, waiting for SuperNodes)
            assert coord.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "coordinator.log").read_text()[-3000:]
            tree = psutil.Process(coord.pid).children(recursive=True)
            if (work / LOCK_FILE).exists() and _locked(work / LOCK_FILE) and \
                    any("serverapp" in " ".join(_cmdline(p)) for p in tree):
                break
            time.sleep(0.3)
        os.kill(coord.pid, signal.SIGKILL)
        coord.wait(10)
        _, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, [" ".join(_cmdline(p))[:120] for p in alive]
        assert not _locked(work / LOCK_FILE)
    finally:
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        if coord.poll() is None:
            coord.kill()


@pytest.mark.nightly  # test_coordinator_chaos's step 1 holds this item in make test (docs/testing.md)
def test_a_dropped_log_stream_does_not_start_a_second_run(tmp_path: Path) -> None:
    """Kill ``flwr run --stream`` mid-run: Flower still runs it, so the coordinator follows it, never resubmits."""
    import os
    import signal
    import sys

    import psutil

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
    from _coordinator import Deployment  # type: ignore[import-not-found]

    dep = Deployment(tmp_path)
    try:
        n = 3
        keys = [dep.authorize(f"dev-{i}") for i in range(n)]
        coord = dep.coordinator("--rounds", "3", "--rule", "median", "--f", "0", "--num-partitions", str(n),
                                "--min-clients", str(n), "--round-timeout", "60", "--grace", "1", "--timeout", "240")
        dep.wait_file(dep.ck / "superlink.json", 90)
        for i in range(n):
            dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={n}")
        dep.wait_file(dep.ck / "ckpt-00000001.json", 120)
        streams = [p for p in psutil.Process(coord.pid).children(recursive=True)
                   if "run" in _cmdline(p) and "--stream" in _cmdline(p)]
        assert len(streams) == 1
        os.kill(streams[0].pid, signal.SIGKILL)
        assert dep.wait_exit(coord, 240) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        assert rep["rounds_done"] == 3 and rep["resumed_from"] == 0  # one run did all three rounds
        text = (tmp_path / "coordinator.log").read_text()
        assert "ended but Flower says it is running" in text and text.count("submitted run") == 1
    finally:
        dep.close()

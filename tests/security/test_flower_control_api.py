"""Issue 20 finding 1: the SuperLink's public CA certificate was enough to run code on the coordinator.

``flower-superlink`` serves its Control API (runs, SuperNode keys) and Runtime API
on the same address as the Fleet API, without authentication. Every device holds
the CA certificate, so a device (or anyone who copied the file) could ``flwr ls``,
``flwr supernode register`` a key of its own and ``flwr run`` an app whose
ServerApp runs on the coordinator host. The attacker here is a real ``flwr`` CLI
with only that CA file, pointed at every port the coordinator's (and a site
aggregator's) process tree listens on at the address devices dial (127.0.0.2;
Linux routes it over loopback, and a socket bound to 127.0.0.1 is not reachable
through it, as a loopback-only socket is not from another host). All three are
refused; authenticated SuperNodes dialling that same address still train, and (finding 14,
the same coordinator) Byzantine replies and an impostor SuperNode do not stop its rounds.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from cloud_coordinator.app import bundled_app
from runtime.broker import free_port

from _coordinator import VENV_BIN, Deployment, kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]
DEVICE_HOST = "127.0.0.2"


def _device_ports(pid: int) -> set[int]:
    """TCP ports the process tree of ``pid`` listens on that a connection to DEVICE_HOST reaches."""
    root = psutil.Process(pid)
    ports: set[int] = set()
    for p in (root, *root.children(recursive=True)):
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ports |= {c.laddr.port for c in conns
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip in (DEVICE_HOST, "0.0.0.0", "::")}
    return ports


def _flwr(env: dict[str, str], cwd: Path, *argv: str) -> dict[str, object]:
    """A real ``flwr`` command with ``--format json``: its JSON answer (success false when it printed none)."""
    r = subprocess.run([str(VENV_BIN / "flwr"), *argv, "--format", "json"], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=120, check=False)
    try:
        doc = json.loads(r.stdout[r.stdout.index("{"):])
    except ValueError:
        doc = {"success": False, "error-message": (r.stdout + r.stderr)[-300:]}
    return {**doc, "returncode": r.returncode} if isinstance(doc, dict) else {"success": False}


def _attack(dep: Deployment, pid: int, ca: Path, tag: str) -> list[int]:
    """flwr ls / supernode register / run with only ``ca`` against every device-reachable port: all refused."""
    ports = sorted(_device_ports(pid))
    assert ports, "nothing listens on the devices' address"
    att = dep.root / f"attacker-{tag}"
    att.mkdir()
    shutil.copy(ca, att / "ca.pem")  # the public CA file every device gets: all the attacker holds
    assert dep.fogline("supernodes", "keygen", "--out", str(att / "key")).returncode == 0
    app = att / "app"
    shutil.copytree(bundled_app("digits"), app)
    toml = app / "pyproject.toml"
    toml.write_text(toml.read_text().replace('name = "digits-app"', 'name = "attacker-app"'))
    for port in ports:
        home = att / f"home-{port}"
        home.mkdir()
        (home / "config.toml").write_text(f'[superlink]\ndefault = "target"\n\n[superlink.target]\n'
                                          f'address = "{DEVICE_HOST}:{port}"\nroot-certificates = "{att / "ca.pem"}"\n')
        env = {**dep.env, "FLWR_HOME": str(home)}
        for argv in (("ls", "target"), ("supernode", "register", str(att / "key" / "supernode.pub"), "target"),
                     ("run", str(app), "target")):
            out = _flwr(env, att, *argv)
            assert out.get("success") is not True, f"flwr {argv[0]} on {DEVICE_HOST}:{port} was accepted: {out}"
    return ports


def _legit(work: Path, *argv: str) -> dict[str, object]:
    """The owner's own ``flwr`` (the coordinator's connection, its loopback Control API)."""
    env = {**os.environ, "FLWR_HOME": str(work / ".flwr"), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1"}
    out = _flwr(env, work, *argv, "fogline")
    assert out.get("success") is True, out
    return out


def test_a_ca_holder_cannot_use_the_coordinators_control_api_and_devices_still_train(tmp_path: Path) -> None:
    """The same coordinator also holds finding 14's rounds (test_coordinator_byzantine's first
    test, nightly, on 127.0.0.1): a reply with an absurd example count, a NaN reply and an
    impostor with an unregistered key claiming ``dev-0`` are counted and the rounds complete."""
    dep = Deployment(tmp_path)
    dep.host = DEVICE_HOST
    try:
        n = 5
        roles = {3: " byzantine='inf-examples'", 4: " byzantine='nan'"}
        keys = [dep.authorize(f"dev-{i}") for i in range(n)]
        cwd = tmp_path / "cwd"  # issue 24: a fogline/ folder in the cwd made every flwr command fail
        (cwd / "fogline").mkdir(parents=True)
        (cwd / "fogline" / "pyproject.toml").write_text('[project]\nname = "fogline"\n')
        coord = dep.coordinator("--rounds", "2", "--rule", "median", "--f", "1", "--num-partitions", str(n),
                                "--min-clients", "3", "--round-timeout", "60", "--grace", "2", "--timeout", "300",
                                cwd=cwd)
        dep.wait_file(dep.ck / "superlink.json", 60)  # the keys are registered: SuperNodes may connect
        ports = _attack(dep, coord.pid, dep.ck / "superlink-tls" / "ca.pem", "cloud")
        assert dep.port in ports
        runs = _legit(dep.ck, "ls")["runs"]
        assert all(r["fab-name"] == "digits-app" for r in runs), runs  # type: ignore[attr-defined,index]
        nodes = json.dumps(_legit(dep.ck, "supernode", "list"))
        attacker_pub = (tmp_path / "attacker-cloud" / "key" / "supernode.pub").read_text().split()[1]
        assert attacker_pub[:40] not in nodes
        for i in range(n):  # real authenticated SuperNodes on the same address
            dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={n}{roles.get(i, '')}")
        impostor_key = tmp_path / "impostor"
        assert dep.fogline("supernodes", "keygen", "--out", str(impostor_key)).returncode == 0
        dep.node("impostor", impostor_key / "supernode.key", f"device-id='dev-0' partition-id=0 num-partitions={n}")
        assert dep.wait_exit(coord, 300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        rep = json.loads((dep.ck / "report.json").read_text())
        assert rep["rounds_done"] == 2
        for h in rep["history"]:
            assert h["clients"] == [f"dev-{i}" for i in range(n)]  # the impostor never got a round
            assert h["rejected"].get("dev-3") == "absurd example count"
            assert h["rejected"].get("dev-4") == "non-finite values"
            assert h["accepted"] == ["dev-0", "dev-1", "dev-2"] and not h.get("skipped")
        assert rep["history"][-1]["server"]["accuracy"] > 0.8
    finally:
        dep.close()


def test_a_ca_holder_cannot_use_a_site_aggregators_control_api(tmp_path: Path) -> None:
    dep = Deployment(tmp_path)
    work = tmp_path / "site"
    port = free_port()
    with open(tmp_path / "site.log", "wb") as log:  # the child keeps its own copy
        agg = subprocess.Popen([str(VENV_BIN / "fogline"), "-v", "site-aggregator", "--app",
                                str(bundled_app("digits")), "--work-dir", str(work), "--site", "site-a",
                                "--listen", f"{DEVICE_HOST}:{port}"],
                               stdout=log, stderr=subprocess.STDOUT, env=dep.env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (work / "superlink.json").exists():
            assert agg.poll() is None and time.monotonic() < deadline, (tmp_path / "site.log").read_text()[-3000:]
            time.sleep(0.2)
        assert port in _attack(dep, agg.pid, work / "superlink-tls" / "ca.pem", "site")
        runs = _legit(work, "ls")["runs"]
        assert all(r["fab-name"] == "digits-app" for r in runs), runs  # type: ignore[attr-defined,index]
    finally:
        kill_tree(agg)

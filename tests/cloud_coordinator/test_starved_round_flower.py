"""Issue 28 with real Flower: a round whose replies never come is retried, then the run stops loudly.

Real processes on 127.0.0.1: ``fogline coordinator`` (TLS SuperLink, SuperExec, ServerApp, the digits
app with its release hook) and two authenticated ``flower-supernode`` processes. Round 1 trains and is
released; then both SuperNodes (with their ClientApps) are paused with SIGSTOP, past every deadline.
Round 2 gets no quorum: it is retried under the same number with its reason, and after the retry budget
the run ends with ``fatal.json``, exit code 2, no checkpoint and no release for round 2, no report.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from cloud_coordinator.app import bundled_app

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from _coordinator import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

N = 2


def test_a_round_whose_supernodes_are_paused_is_retried_then_the_run_fails_without_a_release(
        tmp_path: Path) -> None:
    dep = Deployment(tmp_path)
    log = tmp_path / "coordinator.log"
    nodes = []
    try:
        keys = [dep.authorize(f"dev-{i}") for i in range(N)]
        coord = dep.coordinator("--app", str(bundled_app("digits")), "--rounds", "3", "--rule", "median", "--f", "0",
                                "--num-partitions", str(N), "--min-clients", str(N), "--min-replies", str(N),
                                "--round-timeout", "30", "--max-round-timeout", "40", "--max-attempts", "2",
                                "--grace", "0", "--timeout", "360", "--seed", "3")
        wait_for(lambda: (dep.ck / "superlink.json").exists() or coord.poll() is not None, 150,
                 lambda: f"the SuperLink: {log.read_text(errors='replace')[-3000:]}", interval=0.2)
        nodes = [dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={N}") for i in range(N)]
        releases = dep.ck / "releases"
        wait_for(lambda: list(releases.glob("digits-v*.release")) or coord.poll() is not None, 200,
                 lambda: f"round 1's release: {log.read_text(errors='replace')[-3000:]}", interval=0.2)
        assert (dep.ck / "ckpt-00000001.json").exists(), log.read_text(errors="replace")[-3000:]
        for p in nodes:  # the SuperNodes and their ClientApps stop answering (their sockets stay open)
            os.killpg(p.pid, signal.SIGSTOP)
        rc = dep.wait_exit(coord, 300)
        text = log.read_text(errors="replace")
        assert rc == 2, text[-3000:]
        fatal = json.loads((dep.ck / "fatal.json").read_text())["error"]
        # the retry budget spent on round 2, each attempt's reason the replies it got against the quorum
        assert "\n" not in fatal and re.match(r"round 2 failed 2 attempts, last: 0/2 replies within \d+(\.\d+)? s "
                                               r"\(quorum 2\b.*nothing was released$", fatal), fatal
        assert text.strip().splitlines()[-1] == f"error: {fatal}", text[-3000:]  # and one line says so
        progress = json.loads((dep.ck / "progress.json").read_text())
        assert progress["round"] == 2 and progress["retries"] == 1 and progress["quorum"] == N, progress
        assert progress["retried"].startswith("0/2 replies within"), progress
        # nothing counts round 2: no checkpoint, no new release, no report
        assert not (dep.ck / "ckpt-00000002.json").exists()
        assert len(list(releases.glob("digits-v*.release"))) == 1  # round 1's only
        assert not (dep.ck / "report.json").exists()
        print(f"\nround 2 starved: {fatal}")
    finally:
        for p in nodes:
            try:
                os.killpg(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        dep.close()

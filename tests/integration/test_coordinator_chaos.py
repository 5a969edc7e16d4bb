"""Chaos on a busy machine: the coordinator's Flower parts die one after the other while 4 processes burn CPU.

Real processes on 127.0.0.1: ``fogline coordinator`` (SuperLink, SuperExec, ServerApp, ``flwr run``),
two authenticated ``flower-supernode`` devices (TLS, own keys), and 4 CPU burners on a 2-core host.
In one run of 4 rounds:

0. key registration is slow: every ``flwr supernode register`` the coordinator runs waits
   ``REGISTER_DELAY_S`` before doing its work (a ``sitecustomize`` on the coordinator's PYTHONPATH,
   so the real Flower CLI runs, late); each key is registered once, never again on a restart;
1. after round 1, the ``flwr run --stream`` process dies (the run goes on: it is followed, not resubmitted);
2. after round 2, the SuperExec is killed, then the ServerApp (a live ServerApp outlives its SuperExec):
   Flower's run is dead and no new one can start; the watchdog must say so in one line, stop the run and
   restart the SuperLink that runs the SuperExec, and the new run resumes;
3. after round 3, the SuperLink process alone gets kill -9 (its SuperExec and ServerApp are orphaned, not
   killed): the coordinator restarts it, stops what the dead one left running, and resubmits;
4. once a new ServerApp works on round 4, the coordinator gets kill -9; started again, it resumes and
   finishes.

The run ends with 4 rounds in one lineage, never two live runs at once (no "locked by another run"),
and a report.json that counts the restarts; the coordinator is never silent (no log line, no progress)
for longer than its watchdog bound plus one Flower query. The rounds already tested elsewhere (a flwr run
exit alone, a kill -9 alone, a SuperLink restart) are here together, on a loaded host.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime import children

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from _coordinator import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BURNERS = 4
BURN = "import time\nend = time.monotonic() + 500\nwhile time.monotonic() < end:\n    pass\n"
WATCHDOG_S = 60.0
REGISTER_DELAY_S = 6.0  # slow next to the CLI's own few seconds; each extra second is the suite's
# Imported by every Python process of the coordinator (PYTHONPATH); acts only in `flwr supernode register`.
SLOW_REGISTER = """import os, sys, time
if os.path.basename(sys.argv[0]) == "flwr" and sys.argv[1:3] == ["supernode", "register"]:
    with open(os.environ["CHAOS_REGISTER_LOG"], "a") as f:
        f.write(sys.argv[sys.argv.index("--name") + 1] + "\\n")
    time.sleep(float(os.environ["CHAOS_REGISTER_DELAY_S"]))
"""


def _procs(root: int, needle: str) -> list[object]:
    import psutil

    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if needle in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


class Silence:
    """The longest time the coordinator said nothing: no log line (either run) and no progress.json write."""

    def __init__(self, *signs: Path) -> None:
        self.signs = signs
        self.last: tuple[int, ...] = ()
        self.since = time.monotonic()
        self.longest = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        seen = tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in self.signs)
        if seen != self.last:
            self.last, self.since = seen, now
        self.longest = max(self.longest, now - self.since)


def _until(what: str, cond: Callable[[], bool], timeout: float, log: Path, quiet: Silence | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s:\n{log.read_text()[-4000:]}"
        if quiet is not None:
            quiet.poll()
        time.sleep(0.3)


def _strays(work: Path) -> list[str]:
    """Flower processes (SuperExec, ServerApp) still running in the work directory, whoever their parent."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if ("flwr-serverapp" in cmd or "flower-superexec" in cmd) and Path(p.cwd()) == work:
                out.append(f"{p.pid}: {cmd[:120]}")
        except psutil.Error:
            continue
    return out


def _kill(procs: list[object]) -> None:
    assert procs, "nothing to kill"
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        except ProcessLookupError:
            pass


def test_flower_parts_die_one_after_another_on_a_busy_host(tmp_path: Path) -> None:
    shim = tmp_path / "slow-register"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_REGISTER)
    registers = tmp_path / "registers.txt"
    dep = Deployment(tmp_path, {**os.environ, "CHAOS_REGISTER_LOG": str(registers),
                                "CHAOS_REGISTER_DELAY_S": str(REGISTER_DELAY_S),
                                "PYTHONPATH": os.pathsep.join(filter(None, (str(shim), os.environ.get("PYTHONPATH"))))})
    n, rounds = 2, 4
    keys = [dep.authorize(f"dev-{i}") for i in range(n)]
    burners = [children.spawn([sys.executable, "-c", BURN]) for _ in range(BURNERS)]
    log = tmp_path / "coordinator.log"
    ck = dep.ck
    quiet = Silence(log, tmp_path / "coordinator-2.log", ck / "progress.json")
    argv = ("--rounds", str(rounds), "--rule", "median", "--f", "0", "--num-partitions", str(n),
            "--min-clients", str(n), "--round-timeout", "40", "--grace", "1", "--timeout", "500",
            "--watchdog", str(WATCHDOG_S))
    t0 = time.monotonic()
    try:
        coord = dep.coordinator(*argv)
        _until("the SuperLink up and the keys registered", (ck / "superlink.json").exists, 150, log, quiet)
        assert json.loads((ck / "superlink.json").read_text())["registered"] == [f"dev-{i}" for i in range(n)]
        for i in range(n):
            dep.node(f"dev-{i}", keys[i], f"partition-id={i} num-partitions={n}")

        def ckpt(r: int) -> Callable[[], bool]:
            return lambda: (ck / f"ckpt-{r:08d}.json").exists()

        _until("round 1", ckpt(1), 150, log, quiet)
        _kill([p for p in _procs(coord.pid, "--stream") if " run " in " ".join(p.cmdline())])  # type: ignore[attr-defined]
        _until("round 2", ckpt(2), 150, log, quiet)
        _kill(_procs(coord.pid, "flower-superexec"))
        _kill(_procs(coord.pid, "flwr-serverapp"))
        # Flower's own verdict on the dead run (about 60 s), the watchdog (60 s), a SuperLink restart and round 3:
        # 240 s ran out at a 1-minute load of 20 with the 4 burners (the step's waits are bounds, not waits)
        _until("the watchdog's restart and round 3", ckpt(3), 360, log, quiet)
        assert "restarting the superexec" in log.read_text()
        # the SuperLink alone dies (kill -9; its SuperExec and ServerApp live on, orphaned)
        killed_at = time.time()
        _kill(_procs(coord.pid, "cloud_coordinator.superlink"))
        # a new ServerApp works on round 4 (it says so in progress.json), then the coordinator dies
        progress = ck / "progress.json"

        def at_work_on_4() -> bool:
            # the ServerApp the dead SuperLink orphaned may still write round 4's progress after the kill: only
            # progress after the coordinator said so and resubmitted is the new ServerApp's
            text = log.read_text()
            seen = text.find("SuperLink died mid-run")
            again = text.find("submitted run", seen) if seen >= 0 else -1
            if again < 0:
                return False
            stamp = text[text.rfind("\n", 0, again) + 1:][:23]  # the resubmission's log time, local
            resubmitted = time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + float(f"0.{stamp[20:]}")
            doc = json.loads(progress.read_text())
            return bool(doc.get("round") == 4 and "attempt" in doc.get("waiting", "")
                        and doc["at"] > max(killed_at, resubmitted))

        _until("the SuperLink's restart and a new ServerApp at work on round 4", at_work_on_4, 200, log, quiet)
        assert "SuperLink died mid-run" in log.read_text()
        os.kill(coord.pid, signal.SIGKILL)
        coord.wait(10)
        again = dep.coordinator(*argv, log_name="coordinator-2")
        _until("the second coordinator's end", lambda: again.poll() is not None, 200, tmp_path / "coordinator-2.log",
               quiet)
        assert again.returncode == 0, (tmp_path / "coordinator-2.log").read_text()[-3000:]
        wall = time.monotonic() - t0

        rep = json.loads((ck / "report.json").read_text())
        assert rep["rounds_done"] == rounds and [h["round"] for h in rep["history"]] == list(range(1, rounds + 1))
        assert rep["resumed_from"] == 3
        assert "supervisor" in rep and rep["supervisor"]["restarts"] == 0  # the second coordinator's own count
        first = log.read_text()
        text = first + (tmp_path / "coordinator-2.log").read_text()
        assert "locked by another coordinator run" not in text
        assert "ended but Flower says it is running" in first  # (1) followed, not resubmitted
        assert "no round progress for" in first and "the SuperExec is down" in first  # (2) one line, with why
        # the start, after the SuperExec restart, and (if Flower marked the run failed before the watchdog's
        # bound) after Flower said so: each one after a reason, never a second live run
        assert first.count("submitted run") in (3, 4) and first.count("submitted run") == (
            1 + first.count("restarting the") + first.count("without finishing") + first.count("SuperLink died")), \
            [ln for ln in first.splitlines() if "submitted run" in ln]
        # (0) slow registration: each key once, in the first start only (not after the SuperLink's restarts
        # nor the coordinator's), and the coordinator said how long it may take
        assert sorted(registers.read_text().split()) == [f"dev-{i}" for i in range(n)]
        assert "registering 2 SuperNode key(s)" in first and "registering" not in (
            tmp_path / "coordinator-2.log").read_text()
        # (3) what the killed SuperLink left running was stopped, and nothing of this run outlives it
        assert not _strays(ck), _strays(ck)
        assert quiet.longest <= WATCHDOG_S + 30, f"silent for {quiet.longest:.0f} s"
        lineage = json.loads((ck / "lineage.json").read_text())
        assert set(lineage) >= {"id", "app", "config"}
        print(f"chaos run: {wall:.0f} s wall with {BURNERS} CPU burners; longest silence {quiet.longest:.0f} s")
    finally:
        for b in burners:
            children.stop(b, 2.0)
        dep.close()

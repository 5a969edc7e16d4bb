"""Run a command beside N CPU-burning processes, then stop them: ``make test-stress``.

    python tests/hogs.py [--hogs 4] -- COMMAND ...

The suite must pass on a busy machine (issue 23: 4 hogs on 2 cores), so its waits are on events
with deadlines derived from the work, never on a quiet machine. The hogs live exactly as long
as the command: they are stopped when it ends, on Ctrl-C, and (``PR_SET_PDEATHSIG``, through
``runtime.children``) when this process is killed, even with SIGKILL. Prints how long the
command took and the load it ran under; exits with the command's code.

It also checks that the command leaves no process behind: this process is made the "child
subreaper" of everything below it (``PR_SET_CHILD_SUBREAPER``), so a process orphaned anywhere
in the run (a mosquitto that outlived its fog, a ClientApp that outlived its SuperNode) becomes
its child instead of init's. Orphans that exit are reaped as the run goes; those still alive
when the command ends are listed, killed, and fail the run (exit code 3 if the command passed).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runtime import children
from runtime.guard import process_table, subreaper

HOG = "while True:\n    pass\n"
LEFT_BEHIND = 3


def _children(known: set[int]) -> dict[int, tuple[str, str]]:
    """This process's children other than ``known``: pid -> (state, command line)."""
    me, found = os.getpid(), {}
    for pid, (ppid, state) in process_table().items():
        if ppid != me or pid in known:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        found[pid] = (state, cmd.strip()[:200])
    return found


def _reap(known: set[int]) -> dict[int, str]:
    """Reap exited orphans; return the live ones (pid -> command line)."""
    live = {}
    for pid, (state, cmd) in _children(known).items():
        if state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        else:
            live[pid] = cmd
    return live


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hogs.py", description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=4, help="CPU-burning processes beside the command (default 4)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.hogs < 0:
        ap.error("a command after --, and --hogs >= 0")
    watching = subreaper()
    hogs = [children.spawn([sys.executable, "-c", HOG], own_session=False) for _ in range(args.hogs)]
    print(f"hogs: {len(hogs)} CPU-burning processes (pids {', '.join(str(h.pid) for h in hogs)}) on "
          f"{os.cpu_count()} cores, beside: {' '.join(command)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    loads: list[float] = []
    code = 1
    try:
        proc = children.spawn(command, stdin=None, own_session=False)  # Ctrl-C reaches it as usual
        known = {h.pid for h in hogs} | {proc.pid}
        while (rc := _wait(proc, 10.0)) is None:  # sample the load while the command runs
            loads.append(os.getloadavg()[0])
            if watching:
                _reap(known)
        code = rc
        if watching:
            time.sleep(1.0)  # an orphan's last exit is not news
            left_behind = _reap(known)
            for pid, cmd in sorted(left_behind.items()):
                print(f"hogs: left behind by the run: pid {pid}: {cmd}", file=sys.stderr, flush=True)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if left_behind:
                print(f"hogs: {len(left_behind)} process(es) outlived the run (killed now)",
                      file=sys.stderr, flush=True)
                code = code or LEFT_BEHIND
            else:
                print("hogs: no process left behind", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = 130
    finally:
        for h in hogs:
            children.stop(h, 2.0)
        elapsed = time.monotonic() - t0
        left = [h.pid for h in hogs if h.poll() is None]
        peak = f", peak 1-min load {max(loads):.1f}" if loads else ""
        print(f"hogs: `{' '.join(command)}` took {elapsed:.1f} s ({elapsed / 60:.1f} min) beside {len(hogs)} "
              f"hogs{peak}; exit code {code}; hogs stopped" + (f", NOT: {left}" if left else ""),
              file=sys.stderr, flush=True)
    return code


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


if __name__ == "__main__":
    sys.exit(main())

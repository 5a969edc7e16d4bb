"""Run a command beside N CPU-burning processes, then stop them: ``make test-stress``.

    python tests/hogs.py [--hogs 4] -- COMMAND ...

The suite must pass on a busy machine (issue 23: 4 hogs on 2 cores), so its waits are on events
with deadlines derived from the work, never on a quiet machine. The hogs live exactly as long
as the command: they are stopped when it ends, on Ctrl-C, and (``PR_SET_PDEATHSIG``, through
``runtime.children``) when this process is killed, even with SIGKILL. Prints how long the
command took and the load it ran under; exits with the command's code.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from runtime import children

HOG = "while True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hogs.py", description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=4, help="CPU-burning processes beside the command (default 4)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.hogs < 0:
        ap.error("a command after --, and --hogs >= 0")
    hogs = [children.spawn([sys.executable, "-c", HOG], own_session=False) for _ in range(args.hogs)]
    print(f"hogs: {len(hogs)} CPU-burning processes (pids {', '.join(str(h.pid) for h in hogs)}) on "
          f"{os.cpu_count()} cores, beside: {' '.join(command)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    loads: list[float] = []
    code = 1
    try:
        proc = children.spawn(command, stdin=None, own_session=False)  # Ctrl-C reaches it as usual
        while (rc := _wait(proc, 10.0)) is None:  # sample the load while the command runs
            loads.append(os.getloadavg()[0])
        code = rc
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

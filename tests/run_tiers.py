"""Run the suite as tiers, one pytest step after another: ``make test``, ``make test-fast`` and
``make test-flaky`` call this.

Steps, in order (tests/conftest.py checks the markers they select on):

- ``unit``: unmarked tests, on ``-n`` worker processes (pure: they share the machine freely);
- ``integration``: ``pytest.mark.integration``, on ``-n`` workers, a file per worker at a time
  (``--dist loadfile``: module-scoped brokers and sites are built once);
- ``serial``: integration tests marked ``serial`` (they cannot share the machine), one at a time;
- ``e2e``: the whole-system giants (``pytest.mark.e2e``, old name ``slow``), one at a time;
- ``nightly`` (not in ``make test``: ``make test-nightly``): giants marked ``nightly`` whose
  acceptance items a test in the other steps holds too (docs/testing.md has the table).

A step that selects nothing (pytest's exit code 5, e.g. a narrowed run) is no failure. ``make
test`` stops at the first failing step, so a unit failure answers in minutes. The last line sums
all steps up as ``tiers: N passed, N failed, N skipped``.

``--flaky N`` runs the integration, serial and e2e steps N times (never stopping) and lists every
test that failed at least once, with how often.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

NO_TESTS = 5  # pytest's exit code when a step selects no test
MAKE_TEST = ("unit", "integration", "serial", "e2e")  # the steps of make test, in order: no nightly


@dataclass(frozen=True)
class Step:
    name: str
    markers: str
    workers: int  # 0: in the pytest process itself
    dist: str = "load"


def steps(unit_workers: int, integration_workers: int) -> dict[str, Step]:
    return {s.name: s for s in (
        Step("unit", "not integration and not e2e", unit_workers),
        Step("integration", "integration and not e2e and not serial", integration_workers,
             "loadfile"),
        Step("serial", "integration and serial and not e2e", 0),
        Step("e2e", "e2e and not nightly", 0),
        Step("nightly", "nightly", 0),
    )}


@dataclass
class Outcome:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: tuple[str, ...] = ()


def read_junit(path: Path) -> Outcome:
    """Counts and failed test ids from a pytest junit file (empty when pytest wrote none)."""
    out = Outcome()
    if not path.exists():
        return out
    failures: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if kinds & {"failure", "error"}:
            out.failed += 1
            failures.append(name)
        elif "skipped" in kinds:
            out.skipped += 1
        else:
            out.passed += 1
    out.failures = tuple(failures)
    return out


def run_step(step: Step, args: list[str], tmp: Path, tag: str = "") -> tuple[int, Outcome, float]:
    junit = tmp / f"{step.name}{tag}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "--durations=10", f"--junitxml={junit}",
           "-m", step.markers]
    if step.workers:
        cmd += ["-n", str(step.workers), "--dist", step.dist]
    cmd += args
    print(f"\n=== tier {step.name}{tag}: {' '.join(cmd[3:])}", flush=True)
    started = time.monotonic()
    code = subprocess.call(cmd)
    took = time.monotonic() - started
    outcome = read_junit(junit)
    if code == NO_TESTS:
        code = 0
    elif code != 0 and outcome.failed == 0:
        outcome.failed = 1  # pytest itself failed (collection, usage): count it
        outcome.failures = (f"{step.name}: pytest exited {code}",)
    print(f"=== tier {step.name}{tag}: {outcome.passed} passed, {outcome.failed} failed, "
          f"{outcome.skipped} skipped in {took:.0f} s", flush=True)
    return code, outcome, took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(MAKE_TEST),
                        help="comma-separated steps to run, in this order")
    parser.add_argument("--unit-workers", type=int,
                        default=int(os.environ.get("FOGLINE_UNIT_WORKERS", "2")))
    parser.add_argument("--integration-workers", type=int,
                        default=int(os.environ.get("FOGLINE_INTEGRATION_WORKERS", "2")))
    parser.add_argument("--keep-going", action="store_true", help="run every step even after a failure")
    parser.add_argument("--flaky", type=int, metavar="N", default=0,
                        help="run the integration, serial and e2e steps N times; list what failed")
    parser.add_argument("pytest_args", nargs="*", default=["tests"],
                        help="paths and pytest options (after --), default: tests")
    ns = parser.parse_args(argv)
    table = steps(ns.unit_workers, ns.integration_workers)
    names = ns.tiers.split(",") if not ns.flaky else ["integration", "serial", "e2e"]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown tier {unknown[0]!r}: one of {', '.join(table)}")
    args = ns.pytest_args or ["tests"]
    total = Outcome()
    times: list[str] = []
    failed_once: Counter[str] = Counter()
    rounds = max(ns.flaky, 1)
    with tempfile.TemporaryDirectory(prefix="fogline-tiers-") as tmp:
        for r in range(rounds):
            for name in names:
                tag = f"#{r + 1}" if ns.flaky else ""
                code, outcome, took = run_step(table[name], args, Path(tmp), tag)
                total.passed += outcome.passed
                total.failed += outcome.failed
                total.skipped += outcome.skipped
                failed_once.update(outcome.failures)
                times.append(f"{name}{tag} {took:.0f} s")
                if code and not (ns.keep_going or ns.flaky):
                    print(f"\ntier {name} failed: later tiers not run", flush=True)
                    break
            else:
                continue
            break
    print(f"\ntier times: {', '.join(times)}")
    if ns.flaky:
        print(f"flaky report, {rounds} runs of {', '.join(names)}: "
              f"{len(failed_once)} tests failed at least once")
        for test, n in failed_once.most_common():
            print(f"  failed {n}/{rounds}: {test}")
    print(f"tiers: {total.passed} passed, {total.failed} failed, {total.skipped} skipped")
    return 1 if total.failed else 0


if __name__ == "__main__":
    sys.exit(main())

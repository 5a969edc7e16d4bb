"""Where every benchmark's JSON goes: stdout, and ``out/bench/NAME.json`` under the repository."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "out" / "bench"


def emit(name: str, result: Any, *, path: Path | None = None, stdout: Any = None) -> Path:
    """Write ``result`` as JSON to ``path`` (default out/bench/NAME.json) and print it (or ``stdout``)."""
    dest = path or OUT_DIR / f"{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1, default=str)
    dest.write_text(text + "\n")
    print(text if stdout is None else json.dumps(stdout, indent=1, default=str))
    return dest


def run_header(name: str, quick: bool, **extra: Any) -> dict[str, Any]:
    """What every benchmark's JSON starts with: which run it was and how busy the machine was."""
    return {"benchmark": name, "quick": quick, **extra, "cpu_count": os.cpu_count(),
            "loadavg_at_start": round(os.getloadavg()[0], 2)}


def quick_main(name: str, run: Callable[[bool], Any], summary: Callable[[Any], str],
               argv: Sequence[str] | None, *, description: str | None, quick_help: str) -> int:
    """``main`` of a benchmark whose one knob is ``--quick``: run, emit the JSON, a summary to stderr."""
    ap = argparse.ArgumentParser(prog=f"{name}_bench", description=description)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args(argv)
    return report(name, run(args.quick), summary)


def report(name: str, result: Any, human: Callable[[Any], str], **emit_args: Any) -> int:
    """A finished run: its JSON (``emit``), then ``human(result)``, a few lines for a person, on stderr."""
    emit(name, result, **emit_args)
    print(human(result), file=sys.stderr)
    return 0

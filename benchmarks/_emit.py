"""Where every benchmark's JSON goes: stdout, and ``out/bench/NAME.json`` under the repository."""
from __future__ import annotations

import json
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

"""``fogline bench serving-overhead``: the code is ``benchmarks.serving_overhead`` (``run_overhead``)."""
from __future__ import annotations

from benchmarks.serving_overhead import main

__all__ = ["main"]

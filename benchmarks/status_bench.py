"""Benchmark: ``fogline status --json`` while the fog's owner thread is overloaded (issue 31).

A real fog broker (``FogService``) on a real mosquitto (loopback), an operator identity issued by
the site, and ``FogClient.status()`` -- what ``fogline status --json`` does -- asked again and again
while threads in the same process flood the fog with inference requests (``svc.infer``, the HTTP
API's path) as fast as the owner thread takes them, so its inbox stays full: the overload phase of
``fogline bench serving`` without the agents, on any machine.

Two modes, side by side in one run, same process, same threads:

- ``inbox``: control requests wait in the owner's inbox behind the flood (the fog before issue 31;
  ``ServiceConfig.control_lane=False``);
- ``lane``: control requests are taken ahead of it, and status reads the site core's snapshot
  (``control_lane=True``, the default).

Reported per mode: status latency p50 / p99 / max (seconds; a status not answered within the
client's 30 s counts as failed, and as 30 s in the percentiles), requests answered, the inbox's
depth (at least ``FILL`` before
the first request) and the inference requests offered per second meanwhile; the ratio of the
p99s. JSON on stdout and in out/bench/status.json.

Run: ``python -m benchmarks.status_bench [--quick]`` (or ``fogline bench status``).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import emit, run_header

FILL = 20_000  # inference requests waiting in the owner's inbox before the first status request
ASK_TIMEOUT_S = 30.0  # a status not answered by then counts as this long in the percentiles


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


def _phase(tmp: Path, port: int, lane: bool | None, asks: int, flooders: int) -> dict[str, Any]:
    from fog_broker.client import FogClient
    from fog_broker.service import FogService, ServiceConfig

    kw: dict[str, Any] = {}
    if lane is not None:
        kw["control_lane"] = lane
    svc = FogService(ServiceConfig(data_dir=tmp / "fog", site="bench", mqtt_port=port, fair_share=False,
                                   **kw)).start()
    stop = threading.Event()
    sent = [0] * flooders
    x = {"x": np.zeros((1, 8), dtype=np.float32)}

    def flood(i: int) -> None:
        while not stop.is_set():
            svc.infer("bench", x, timeout=1.0)
            sent[i] += 1
            if svc.inbox.qsize() > 150_000:  # keep it full, not at its bound (refused at once there)
                time.sleep(0.001)

    took: list[float] = []
    failed = 0
    try:
        creds = Path(svc.site.issue_credentials("op", "operator", tmp / "op", time.time()))
        deadline = time.monotonic() + 10
        while "op" not in svc.control.roles and time.monotonic() < deadline:
            time.sleep(0.05)
        with FogClient("127.0.0.1", port, credentials=creds, insecure=True) as c:
            threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(flooders)]
            for t in threads:
                t.start()
            until = time.monotonic() + 20.0
            while svc.inbox.qsize() < FILL and time.monotonic() < until:  # the inbox fills
                time.sleep(0.05)
            depth = svc.inbox.qsize()
            depths: list[int] = []
            t_start, sent_start = time.monotonic(), sum(sent)
            for _ in range(asks):
                depths.append(svc.inbox.qsize())
                t0 = time.perf_counter()
                try:
                    c.status(timeout=ASK_TIMEOUT_S, limit=100)
                    took.append(time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - a status that did not come back counts as the timeout
                    failed += 1
                    took.append(ASK_TIMEOUT_S)
                time.sleep(0.05)
            elapsed = time.monotonic() - t_start
            offered = sum(sent) - sent_start
            stop.set()
            for t in threads:
                t.join(5)
    finally:
        stop.set()
        svc.stop()
    return {"asks": asks, "answered": len(took) - failed, "failed": failed, "inbox_depth_at_start": depth,
            "inbox_depth_median": sorted(depths)[len(depths) // 2] if depths else None,
            "p50_s": _pct(took, 0.5), "p99_s": _pct(took, 0.99), "max_s": round(max(took), 4) if took else None,
            "inference_offered_per_s": round(offered / elapsed, 1) if elapsed > 0 else None}


def run(quick: bool) -> dict[str, Any]:
    from fog_broker.service import ServiceConfig
    from runtime.broker import BrokerConfig, MosquittoBroker

    asks = 20 if quick else 100
    has_lane = "control_lane" in {f.name for f in dataclasses.fields(ServiceConfig)}
    out = run_header("status", quick, asks=asks, flooders=2)
    with tempfile.TemporaryDirectory(prefix="status-bench-") as d:
        tmp = Path(d)
        broker = MosquittoBroker(BrokerConfig(data_dir=tmp / "mqtt", persistence=False)).start()
        try:
            modes = {"inbox": False, "lane": True} if has_lane else {"inbox": None}
            for label, lane in modes.items():
                out[label] = _phase(tmp / label, broker.port, lane, asks, 2)
        finally:
            broker.stop()
    if has_lane and out["inbox"]["p99_s"] and out["lane"]["p99_s"]:
        out["p99_ratio_lane_vs_inbox"] = round(out["lane"]["p99_s"] / out["inbox"]["p99_s"], 4)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="status_bench", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="20 status requests per mode instead of 100")
    args = ap.parse_args(argv)
    out = run(args.quick)
    emit("status", out)
    import sys
    for k in ("inbox", "lane"):
        if k in out:
            f = out[k]
            print(f"{k:>5}: status p50 {f['p50_s']} s p99 {f['p99_s']} s max {f['max_s']} s "
                  f"({f['answered']}/{f['asks']} answered, inbox {f['inbox_depth_at_start']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

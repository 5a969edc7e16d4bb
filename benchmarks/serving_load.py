"""The secure site and the open-loop HTTPS load the serving benchmarks share.

``serving_bench`` (admission, replicas, a kill) and ``serving_autoscale`` (a step in the offered
rate) both start a real ``LocalSite`` and offer it Poisson arrivals of OIP requests; this is
their one copy, so neither imports the other.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Load", "start_site", "wait_until", "pct", "ms"]


def wait_until(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout:g} s")


def pct(xs: Sequence[float], q: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else None


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


class Load:
    """Open-loop Poisson arrivals of OIP requests over HTTPS; every request's outcome kept."""

    def __init__(self, addr: str, model: str, x: np.ndarray, ca: str, cert: tuple[str, str], slo_s: float) -> None:
        self.url = f"https://{addr}/v2/models/{model}/infer"
        self.ctx = ssl.create_default_context(cafile=ca)
        self.ctx.load_cert_chain(*cert)
        head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True, "timeout": int(slo_s * 1e6)}}).encode()
        self.body = head + np.ascontiguousarray(x, "<f4").tobytes()
        self.headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        self.slo_s = slo_s

    async def _one(self, session: Any, sent: float, out: list[dict[str, Any]]) -> None:
        row: dict[str, Any] = {"sent": sent}
        try:
            async with session.post(self.url, data=self.body, headers=self.headers) as r:
                data = await r.read()
                row["status"] = r.status
                row["retry_after"] = r.headers.get("Retry-After")
                if r.status == 200:
                    hl = r.headers.get("Inference-Header-Content-Length")
                    doc = json.loads(data[:int(hl)] if hl else data)
                    row["replica"] = (doc.get("parameters") or {}).get("replica")
                else:
                    row["error"] = data[:200].decode(errors="replace")
        except Exception as exc:  # noqa: BLE001 - a failed request is a result here
            row["status"] = 0
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        row["latency"] = time.monotonic() - sent
        out.append(row)

    async def _run(self, rate: float, duration: float, seed: int, at: dict[float, Any]) -> list[dict[str, Any]]:
        import aiohttp

        rng = np.random.default_rng(seed)
        out: list[dict[str, Any]] = []
        tasks = []
        conn = aiohttp.TCPConnector(ssl=self.ctx, limit=256)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as session:
            t0 = time.monotonic()
            t = t0
            hooks = sorted(at.items())
            while True:
                t += float(rng.exponential(1.0 / rate))
                if t - t0 >= duration:
                    break
                while hooks and t - t0 >= hooks[0][0]:
                    hooks.pop(0)[1]()  # e.g. the kill, at its time in the phase
                delay = t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(session, time.monotonic(), out)))
            await asyncio.gather(*tasks)
        return out

    def run(self, rate: float, duration: float, seed: int = 0, at: dict[float, Any] | None = None
            ) -> list[dict[str, Any]]:
        return asyncio.run(self._run(rate, duration, seed, at or {}))


def start_site(tmp: Path, name: str, baseline: bool) -> Any:
    from simulations.local_site import LocalSite

    return LocalSite(tmp / name, site=name, log=tmp / f"{name}.log",
                     args=["--http", "0", "--state-interval", "1", "--summary-interval", "1",
                           *(["--primary-only"] if baseline else [])]).start()

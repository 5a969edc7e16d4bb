"""Dynamic batching (issue 33): frames/s and latency of one stage, batched against unbatched.

Run: ``fogline bench batching [--quick]`` (or ``python -m benchmarks.batching_bench``). JSON on stdout
and in ``out/bench/batching.json``; a summary on stderr.

One ``edge_agent.executor.Executor`` (one worker, one onnxruntime intra-op thread, results sealed as
on a device, handed to an in-process publish that notes the time), in this process, two device
classes, each with ``max_batch`` 1 (the baseline) and 8 in the same run:

* **real compute**: ``zoo:resnet`` (3x32x32) with its batch axis opened, run on this CPU;
* **simulated class**: the same model on a simulated device (``device_flops``: 10 ms a frame) whose
  batches cost sublinearly, ``cost(n) = t1 (1 + 0.15 (n - 1))`` (a GPU-like class; ``--sim-batch-slope``).

Per case: the saturated rate (a burst of frames queued at once, frames/s until the last answer) and
an open-loop run (Poisson arrivals at 0.8x the unbatched saturated rate, then at 1.5x it) with
p50/p99 latency and the answered rate. The ratio batched / unbatched is printed per class.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks._emit import run_header

__all__ = ["run", "main"]

_NAME = "batching"
SIM_FRAME_S = 0.010
SIM_SLOPE = 0.15
MAX_BATCH = 8


def _model() -> bytes:
    from models import zoo

    m = zoo.build("resnet")
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.shape.dim[0].dim_param = "N"  # open the batch axis
    return bytes(m.SerializeToString())


class _Sink:
    """Answers as the executor publishes them: request id -> time."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.cond = threading.Condition()

    def publish(self, topic: str, payload: bytes) -> None:
        from runtime import codec
        from runtime.messages import Envelope, InferenceResult

        env = codec.decode(payload)
        res = codec.decode(env.payload) if isinstance(env, Envelope) else None
        if not isinstance(res, InferenceResult):
            raise RuntimeError(f"unexpected publish on {topic}")
        with self.cond:
            self.at[res.request_id] = time.perf_counter()
            self.cond.notify_all()

    def wait(self, n: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cond:
            while len(self.at) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True


def _executor(art: bytes, sim: bool, max_batch: int, sink: _Sink) -> Any:
    from edge_agent.batching import BatchPolicy
    from edge_agent.executor import Executor
    from runtime.relay import Sealer
    from runtime.security import Identity, sha256_hex
    from runtime.topics import Topics

    ex = Executor("d0", Topics("b"), sink.publish, Sealer(Identity.generate("d0")), intra_op_threads=1,
                  queue_size=4096, batch=BatchPolicy(max_batch, 0.002),
                  device_flops=1e10 if sim else None, sim_batch_slope=SIM_SLOPE)
    ex.load(("wl", 1, 0, 0), sha256_hex(art), art, 1000, flops=1e10 * SIM_FRAME_S if sim else None)
    return ex


def _case(art: bytes, sim: bool, max_batch: int, frames: int, offered: list[float], seed: int) -> dict[str, Any]:
    from runtime.messages import Activation, Hop
    from runtime.topics import Topics

    reply = Topics("b").reply("bench")
    route = (Hop("d0", "wl", 1, 0, 0),)
    x = np.random.default_rng(seed).random((1, 3, 32, 32), dtype=np.float32)
    out: dict[str, Any] = {}
    # saturated: a burst queued at once
    sink = _Sink()
    ex = _executor(art, sim, max_batch, sink)
    for i in range(5):  # warm up
        ex.submit(Activation(f"w{i}", "wl", route, 0, reply, {"x": x}))
    sink.wait(5, 60)
    sink.at.clear()
    t0 = time.perf_counter()
    for i in range(frames):
        ex.submit(Activation(f"s{i}", "wl", route, 0, reply, {"x": x}))
    if not sink.wait(frames, 300):
        raise RuntimeError("saturated run did not finish")
    out["saturated_fps"] = round(frames / (max(sink.at.values()) - t0), 2)
    out["batches"], out["batched_frames"] = ex.batches, ex.batched_frames
    # open loop at the given rates
    rng = np.random.default_rng(seed)
    for rate in offered:
        sink.at.clear()
        sent: dict[str, float] = {}
        n = max(20, int(rate * (4 if frames < 400 else 10)))
        t = time.perf_counter()
        for i in range(n):
            t += rng.exponential(1.0 / rate)
            delay = t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            rid = f"o{rate:.0f}-{i}"
            sent[rid] = time.perf_counter()
            ex.submit(Activation(rid, "wl", route, 0, reply, {"x": x}))
        sink.wait(n, 120)
        lat = sorted(sink.at[r] - s for r, s in sent.items() if r in sink.at)
        span = max(sink.at.values()) - min(sent.values())
        out[f"open_{rate:.1f}_fps"] = {
            "offered": round(rate, 2), "answered_fps": round(len(lat) / span, 2),
            "p50_ms": round(1000 * lat[len(lat) // 2], 2), "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2)}
    ex.stop()
    return out


def run(quick: bool) -> dict[str, Any]:
    art = _model()
    frames = 200 if quick else 1000
    out: dict[str, Any] = run_header(_NAME, quick, model="zoo:resnet (batch axis opened)", max_batch=MAX_BATCH,
                                     max_wait_ms=2.0, intra_op_threads=1, sim_frame_ms=SIM_FRAME_S * 1000,
                                     sim_batch_slope=SIM_SLOPE, frames=frames)
    for cls, sim in (("real", False), ("simulated", True)):
        base = _case(art, sim, 1, frames, [], 1)
        rates = [0.8 * base["saturated_fps"], 1.5 * base["saturated_fps"]]
        res = {"unbatched": _case(art, sim, 1, frames, rates, 2),
               "batched": _case(art, sim, MAX_BATCH, frames, rates, 2)}
        u, b = res["unbatched"], res["batched"]
        res["saturated_ratio"] = round(b["saturated_fps"] / u["saturated_fps"], 3)
        for k in [k for k in u if k.startswith("open_")]:
            res[f"{k}_answered_ratio"] = round(b[k]["answered_fps"] / u[k]["answered_fps"], 3)
            res[f"{k}_p99_ratio"] = round(b[k]["p99_ms"] / u[k]["p99_ms"], 3)
        out[cls] = res
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    return out


def _summary(r: dict[str, Any]) -> str:
    parts = []
    for cls in ("real", "simulated"):
        c = r[cls]
        opens = [k for k in c["unbatched"] if k.startswith("open_")]
        hi = opens[-1]
        parts.append(f"{cls}: saturated {c['unbatched']['saturated_fps']} -> {c['batched']['saturated_fps']} frames/s "
                     f"({c['saturated_ratio']}x); at 1.5x offered p99 {c['unbatched'][hi]['p99_ms']} -> "
                     f"{c['batched'][hi]['p99_ms']} ms, answered {c['unbatched'][hi]['answered_fps']} -> "
                     f"{c['batched'][hi]['answered_fps']}/s")
    return "; ".join(parts) + f"; load {r['loadavg_at_start']} -> {r['loadavg_at_end']}"


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks._emit import quick_main
    return quick_main(_NAME, run, _summary, argv, description=__doc__.splitlines()[0],
                      quick_help="200 frames a burst, short open-loop runs (~1 min)")


if __name__ == "__main__":
    sys.exit(main())

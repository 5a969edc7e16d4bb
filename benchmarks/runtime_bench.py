"""Runtime foundation benchmark: codec, envelope signing, MQTT through mosquitto; baselines in the same run.

``python -m benchmarks.runtime_bench [--quick] [--only codec|security|mqtt]`` (or ``fogline bench runtime``)

* codec: MB/s to encode and decode an ``InferenceRequest`` carrying one
  1 MiB float32 array, vs ``pickle`` protocol 5 of the same tensors dict; also
  the decode time of a ``Deploy`` with an 8 MiB artifact, of a signed envelope
  (tight budget), and how fast a 16 MiB decode bomb is refused;
* security: envelopes/s through ``Verifier.open(Signer.seal_bytes(...))``
  (encode, sign, decode, verify, replay window), vs raw ``cryptography``
  Ed25519 sign + verify of the same payload bytes;
* mqtt: QoS1 round trip p50/p99 (ping -> echo -> pong) and one-way
  throughput (msg/s, QoS1 and QoS0, 64-byte payloads) through mosquitto on
  127.0.0.1, ``runtime.mqtt.MqttClient`` vs a raw paho client (with TCP_NODELAY,
  as the adapter sets it: default paho waits ~40 ms per hop on Nagle).

JSON goes to stdout and ``out/bench/runtime.json``; ratios go to stderr.
"""
from __future__ import annotations

import argparse
import pickle
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script (python benchmarks/runtime_bench.py) too: the repository root goes on sys.path
# before the project's imports.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._emit import emit  # noqa: E402
from runtime import codec  # noqa: E402
from runtime.errors import DecodeError  # noqa: E402
from runtime.messages import CommandAck, Deploy, DeviceState, InferenceRequest  # noqa: E402
from runtime.security import Identity, Signer, TrustStore, Verifier  # noqa: E402

MIB = 1024 * 1024


def rate(fn: Callable[[], object], budget_s: float, min_iters: int = 3) -> float:
    """Calls per second of ``fn`` over about ``budget_s`` (best of a few batches)."""
    fn()  # warm up
    best = float("inf")
    batch = 1
    deadline = time.perf_counter() + budget_s
    iters_done = 0
    while time.perf_counter() < deadline or iters_done < min_iters:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        dt = (time.perf_counter() - t0) / batch
        best = min(best, dt)
        iters_done += 1
        if dt * batch < 0.01:
            batch *= 2
    return 1.0 / best


# ---------------------------------------------------------------- codec


def bench_codec(budget: float) -> dict[str, Any]:
    arr = np.random.default_rng(0).standard_normal(MIB // 4, dtype=np.float32)
    msg = InferenceRequest("req-1", "resnet", "fogline/v1/s/reply/c", {"input": arr})
    frame = codec.encode(msg)
    decoded = codec.decode(frame)
    assert isinstance(decoded, InferenceRequest) and np.array_equal(decoded.tensors["input"], arr)
    pick = pickle.dumps(msg.tensors, protocol=5)
    mb = arr.nbytes / MIB
    out = {
        "payload_mib": round(mb, 3),
        "encode_mb_s": rate(lambda: codec.encode(msg), budget) * mb,
        "decode_mb_s": rate(lambda: codec.decode(frame), budget) * mb,
        "pickle5_dumps_mb_s": rate(lambda: pickle.dumps(msg.tensors, protocol=5), budget) * mb,
        "pickle5_loads_mb_s": rate(lambda: pickle.loads(pick), budget) * mb,
        "frame_overhead_bytes": len(frame) - arr.nbytes,
    }
    out["encode_vs_pickle"] = out["encode_mb_s"] / out["pickle5_dumps_mb_s"]
    out["decode_vs_pickle"] = out["decode_mb_s"] / out["pickle5_loads_mb_s"]
    deploy = codec.encode(Deploy("c1", "w", 1, 0, 0, "a" * 64, bytes(8 * MIB), b"s" * 64, "fog", 10**8))
    out["deploy_8mib_decode_ms"] = 1e3 / rate(lambda: codec.decode(deploy), budget)
    env = Signer(Identity.from_seed("dev-1", b"bench"), 1).seal_bytes(DeviceState("dev-1", 1, 1, 10**9), 1.0)
    out["envelope_decode_us"] = 1e6 / rate(lambda: codec.decode_envelope(env), budget)
    meta = b"\xdd" + (16 * MIB - 200).to_bytes(4, "big") + b"\x90" * (16 * MIB - 200)
    bomb = codec.MAGIC + len(meta).to_bytes(4, "little") + meta  # 16 MiB of empty arrays

    def refuse() -> None:
        try:
            codec.decode(bomb)
        except DecodeError:
            return
        raise AssertionError("the decode bomb was accepted")

    out["bomb_16mib_refused_ms"] = 1e3 / rate(refuse, budget, min_iters=1)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


# ---------------------------------------------------------------- security


def bench_security(budget: float) -> dict[str, Any]:
    ident = Identity.from_seed("dev-1", b"bench")
    verifier = Verifier(TrustStore({"dev-1": ident.public_key_bytes}), window=64)
    signer = Signer(ident, epoch=1)
    msg = CommandAck("cmd-1", "dev-1", True, "deployed")
    now = time.time()

    def envelope() -> None:
        verifier.open(signer.seal_bytes(msg, now), now)

    payload = codec.encode(msg)
    key = ident._key
    pub = key.public_key()

    def raw() -> None:
        pub.verify(key.sign(payload), payload)

    out = {"envelope_seal_open_per_s": rate(envelope, budget), "raw_sign_verify_per_s": rate(raw, budget)}
    out["envelope_vs_raw"] = out["envelope_seal_open_per_s"] / out["raw_sign_verify_per_s"]
    assert verifier.accepted > 0 and not verifier.rejected
    return {k: round(v, 3 if k.endswith("raw") else 0) for k, v in out.items()}


# ---------------------------------------------------------------- mqtt


class _Pair:
    """Two connected clients (ping side and echo side) of one flavour, plus a one-way counter."""

    def __init__(self, flavour: str, port: int) -> None:
        self.flavour, self.port = flavour, port
        self.pongs: queue.Queue[bytes] = queue.Queue()
        self.count = 0
        self.target = 0
        self.all_in = threading.Event()
        self._closers: list[Callable[[], None]] = []

    def _count(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.all_in.set()

    def start(self) -> _Pair:
        if self.flavour == "runtime":
            from runtime.mqtt import Inbound, MqttClient

            a = MqttClient(f"bench-a-{id(self)}", "127.0.0.1", self.port)
            b = MqttClient(f"bench-b-{id(self)}", "127.0.0.1", self.port)
            a.subscribe("bench/pong", lambda m: self.pongs.put(m.payload), qos=1)
            a.subscribe("bench/flow", lambda m: self._count(), qos=1)

            def echo(m: Inbound) -> None:
                b.publish("bench/pong", m.payload, qos=1)
            b.subscribe("bench/ping", echo, qos=1)
            for c in (a, b):
                c.start()
                assert c.wait_connected(10)
                self._closers.append(c.stop)
            self.publish = lambda t, p, q: a.publish(t, p, qos=q)
            self.echo_publish = b.publish
        else:
            import paho.mqtt.client as mqtt

            def mk(name: str) -> Any:
                c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
                c.max_inflight_messages_set(100)
                c.max_queued_messages_set(10_000)
                # same socket option as the adapter, so the ratio measures the adapter, not Nagle
                # (default paho measured ~44 ms p50 RTT here against ~0.5 ms with it)

                def nodelay(cl: Any, u: Any, sock: Any) -> None:
                    if isinstance(sock, socket.socket):  # TCP (not a websocket wrapper)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.on_socket_open = nodelay
                return c

            a, b = mk(f"raw-a-{id(self)}"), mk(f"raw-b-{id(self)}")

            def on_a(cl: Any, u: Any, m: Any) -> None:
                if m.topic == "bench/pong":
                    self.pongs.put(m.payload)
                else:
                    self._count()

            a.on_message = on_a
            b.on_message = lambda cl, u, m: cl.publish("bench/pong", m.payload, qos=1)
            for c, subs in ((a, [("bench/pong", 1), ("bench/flow", 1)]), (b, [("bench/ping", 1)])):
                ok = threading.Event()

                def on_connect(cl: Any, u: Any, f: Any, rc: Any, p: Any, subs: Any = subs, ok: Any = ok) -> None:
                    cl.subscribe(subs)

                c.on_connect = on_connect
                c.on_subscribe = lambda *args, ok=ok: ok.set()
                c.connect("127.0.0.1", self.port, keepalive=10)
                c.loop_start()
                assert ok.wait(10)

                def close(c: Any = c) -> None:
                    c.disconnect()
                    c.loop_stop()
                self._closers.append(close)
            self.publish = lambda t, p, q: a.publish(t, p, qos=q)
        self._warm()
        return self

    def _warm(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.publish("bench/ping", b"warm", 1)
            try:
                self.pongs.get(timeout=0.2)
                break
            except queue.Empty:
                continue
        while not self.pongs.empty():
            self.pongs.get_nowait()

    def rtt(self, n: int) -> list[float]:
        samples = []
        for i in range(n):
            payload = i.to_bytes(4, "little") + b"x" * 60
            t0 = time.perf_counter()
            self.publish("bench/ping", payload, 1)
            while self.pongs.get(timeout=5) != payload:
                pass
            samples.append(time.perf_counter() - t0)
        return samples

    def flow(self, n: int, qos: int, deadline_s: float) -> dict[str, Any]:
        self.count, self.target = 0, n
        self.all_in.clear()
        payload = b"y" * 64
        t0 = time.perf_counter()
        for _ in range(n):
            self.publish("bench/flow", payload, qos)
        self.all_in.wait(deadline_s)
        dt = time.perf_counter() - t0
        return {"msg_per_s": round(self.count / dt), "delivered": round(self.count / n, 4)}

    def close(self) -> None:
        for c in self._closers:
            c()


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def bench_mqtt(quick: bool) -> dict[str, Any]:
    from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto

    if find_mosquitto() is None:
        return {"error": "mosquitto not installed"}
    n_rtt = 200 if quick else 1000
    n_flow = 2000 if quick else 10000
    out: dict[str, Any] = {"rtt_samples": n_rtt, "flow_messages": n_flow}
    with tempfile.TemporaryDirectory(prefix="fogline-bench-") as tmp:
        broker = MosquittoBroker(BrokerConfig(data_dir=Path(tmp), persistence=False)).start()
        try:
            for flavour in ("runtime", "raw_paho"):
                pair = _Pair(flavour, broker.port).start()
                try:
                    rtts = pair.rtt(n_rtt)
                    out[flavour] = {
                        "rtt_p50_ms": round(statistics.median(rtts) * 1e3, 3),
                        "rtt_p99_ms": round(_pct(rtts, 0.99) * 1e3, 3),
                        "qos1": pair.flow(n_flow, 1, 30),
                        "qos0": pair.flow(n_flow, 0, 10),
                    }
                finally:
                    pair.close()
        finally:
            broker.stop()
    r, p = out["runtime"], out["raw_paho"]
    out["ratios"] = {
        "rtt_p50_vs_raw": round(r["rtt_p50_ms"] / p["rtt_p50_ms"], 3),
        "qos1_vs_raw": round(r["qos1"]["msg_per_s"] / max(p["qos1"]["msg_per_s"], 1), 3),
        "qos0_vs_raw": round(r["qos0"]["msg_per_s"] / max(p["qos0"]["msg_per_s"], 1), 3),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="runtime_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (< 30 s)")
    ap.add_argument("--only", choices=("codec", "security", "mqtt"), action="append",
                    help="run only this part (repeatable); the default runs all three")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "runtime.json"))
    args = ap.parse_args(argv)
    budget = 0.5 if args.quick else 2.0
    parts = set(args.only or ("codec", "security", "mqtt"))
    t0 = time.perf_counter()
    result: dict[str, Any] = {"quick": args.quick}
    if "codec" in parts:
        result["codec"] = bench_codec(budget)
    if "security" in parts:
        result["security"] = bench_security(budget)
    if "mqtt" in parts:
        result["mqtt"] = bench_mqtt(args.quick)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    emit("runtime", result, path=Path(args.out))
    c, s, m = result.get("codec"), result.get("security"), result.get("mqtt", {})
    if c:
        print(f"codec encode {c['encode_mb_s']:.0f} MB/s = {c['encode_vs_pickle']:.2f}x pickle5; "
              f"decode {c['decode_mb_s']:.0f} MB/s = {c['decode_vs_pickle']:.1f}x pickle5; "
              f"Deploy 8 MiB {c['deploy_8mib_decode_ms']} ms, envelope {c['envelope_decode_us']} us, "
              f"16 MiB bomb refused in {c['bomb_16mib_refused_ms']:.0f} ms", file=sys.stderr)
    if s:
        print(f"envelope seal+open {s['envelope_seal_open_per_s']:.0f}/s = {s['envelope_vs_raw']:.2f}x raw "
              f"Ed25519 sign+verify ({s['raw_sign_verify_per_s']:.0f}/s)", file=sys.stderr)
    if "ratios" in m:
        print(f"mqtt rtt p50 {m['runtime']['rtt_p50_ms']} ms ({m['ratios']['rtt_p50_vs_raw']}x raw paho), "
              f"qos1 {m['runtime']['qos1']['msg_per_s']} msg/s ({m['ratios']['qos1_vs_raw']}x), "
              f"qos0 {m['runtime']['qos0']['msg_per_s']} msg/s ({m['ratios']['qos0_vs_raw']}x)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

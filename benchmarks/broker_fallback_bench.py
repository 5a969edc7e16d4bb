"""Which zero-install MQTT broker can stand in for mosquitto? Measure, don't guess.

``python -m benchmarks.broker_fallback_bench [--quick] [--candidates mosquitto,iotcore,amqtt]``

For each candidate broker (run in a child process on 127.0.0.1), with a raw
paho client (MQTT 5 where the broker speaks it, else 3.1.1):

* QoS1 throughput: a publisher sends N 64-byte messages as fast as paho
  queues them; msg/s counts messages the subscriber received until the last
  one (or the deadline), and ``delivered`` the fraction that arrived;
* Will on kill -9: a client process with a Will is SIGKILLed; latency of the Will;
* Will on a hung client: the client process is SIGSTOPped (keepalive 2 s);
  the broker should publish the Will after ~1.5 x keepalive;
* whether an MQTT 5 CONNECT is accepted (runtime.mqtt speaks only MQTT 5).

mosquitto is the baseline of the same run. JSON goes to stdout and
``out/bench/broker_fallback.json``.
"""
from __future__ import annotations

import argparse
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from benchmarks._emit import emit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto, free_port, wait_port  # noqa: E402

AMQTT_SERVER = textwrap.dedent("""
    import asyncio, logging, sys
    logging.disable(logging.CRITICAL)
    from amqtt.broker import Broker
    config = {"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{sys.argv[1]}"}},
              "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}}
    async def main():
        broker = Broker(config)
        await broker.start()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    asyncio.run(main())
""")

VICTIM = textwrap.dedent("""
    import sys, time
    import paho.mqtt.client as mqtt
    port, topic, proto = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="victim-" + sys.argv[4], protocol=proto)
    c.will_set(topic, b"dead", qos=1)
    c.connect("127.0.0.1", port, keepalive=2)
    c.loop_start()
    deadline = time.monotonic() + 10
    while not c.is_connected() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("ready" if c.is_connected() else "failed", flush=True)
    time.sleep(120)
""")


class _Proc:
    """A broker child process with MosquittoBroker's surface (enough for this benchmark)."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.host, self.port = "127.0.0.1", port
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if not wait_port(self.host, port, 20):
            self.stop()
            raise RuntimeError(f"{argv[:3]} did not open port {port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.proc.stdin:
            self.proc.stdin.close()


def start_candidate(name: str, tmp: Path) -> Any:
    if name == "mosquitto":
        return MosquittoBroker(BrokerConfig(data_dir=tmp / "mosquitto", persistence=False)).start()
    if name == "iotcore":
        from runtime.fallback_broker import FallbackBroker

        return FallbackBroker(tmp / "iotcore").start()
    if name == "amqtt":
        port = free_port()
        return _Proc([sys.executable, "-c", AMQTT_SERVER, str(port)], port)
    raise ValueError(name)


def _client(name: str, port: int, proto: mqtt.MQTTProtocolVersion) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=proto)
    c.max_inflight_messages_set(100)
    c.max_queued_messages_set(0)
    return c


def _connect(c: mqtt.Client, port: int, timeout: float = 5.0) -> bool:
    ok = threading.Event()
    c.on_connect = lambda cl, u, f, rc, p=None: ok.set() if not rc.is_failure else None
    try:
        c.connect("127.0.0.1", port, keepalive=10)
    except OSError:
        return False
    c.loop_start()
    return ok.wait(timeout)


def supports_v5(port: int) -> bool:
    c = _client("probe-v5", port, mqtt.MQTTv5)
    try:
        return _connect(c, port, 3.0)
    finally:
        c.disconnect()
        c.loop_stop()


def throughput(port: int, proto: mqtt.MQTTProtocolVersion, n: int,
               deadline_s: float) -> dict[str, Any]:
    got = 0
    done = threading.Event()
    first_sent = [0.0]
    last_rx = [0.0]

    def on_message(cl: Any, u: Any, msg: Any) -> None:
        nonlocal got
        got += 1
        last_rx[0] = time.perf_counter()
        if got >= n:
            done.set()

    sub, pub = _client("bench-sub", port, proto), _client("bench-pub", port, proto)
    sub.on_message = on_message
    subscribed = threading.Event()
    sub.on_subscribe = lambda *a: subscribed.set()
    try:
        if not (_connect(sub, port) and _connect(pub, port)):
            return {"error": "could not connect"}
        sub.subscribe("bench/t", qos=1)
        subscribed.wait(5)
        payload = b"x" * 64
        first_sent[0] = time.perf_counter()
        for _ in range(n):
            pub.publish("bench/t", payload, qos=1)
        done.wait(deadline_s)
        end = last_rx[0] if got else time.perf_counter()
        elapsed = max(end - first_sent[0], 1e-9)
        return {"messages": n, "received": got, "delivered": round(got / n, 4),
                "msg_per_s": round(got / elapsed), "seconds": round(elapsed, 3),
                "completed": got >= n}
    finally:
        for c in (sub, pub):
            c.disconnect()
            c.loop_stop()


def will_latency(port: int, proto: mqtt.MQTTProtocolVersion, how: str,
                 timeout: float) -> dict[str, Any]:
    """Latency of a Will after the client process is SIGKILLed ('kill') or SIGSTOPped ('hang')."""
    topic = f"bench/will/{how}"
    inbox: queue.Queue[float] = queue.Queue()
    watcher = _client(f"watch-{how}", port, proto)
    watcher.on_message = lambda cl, u, m: inbox.put(time.monotonic())
    if not _connect(watcher, port):
        return {"error": "watcher could not connect"}
    watcher.subscribe(topic, qos=1)
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, str(port), topic, str(proto), how],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        if not ready or proc.stdout.readline().strip() != b"ready":
            return {"error": "victim could not connect"}
        time.sleep(0.2)  # let the watcher's SUBACK land
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            t = inbox.get(timeout=timeout)
            return {"will": True, "latency_s": round(t - t0, 3)}
        except queue.Empty:
            return {"will": False, "waited_s": timeout}
    finally:
        proc.kill()
        proc.wait(timeout=5)
        watcher.disconnect()
        watcher.loop_stop()


def bench_one(name: str, tmp: Path, n: int, deadline_s: float) -> dict[str, Any]:
    try:
        broker = start_candidate(name, tmp)
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot start is a result
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        v5 = supports_v5(broker.port)
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        out: dict[str, Any] = {"mqtt5": v5, "protocol": "5" if v5 else "3.1.1"}
        out["qos1"] = throughput(broker.port, proto, n, deadline_s)
        out["will_on_kill9"] = will_latency(broker.port, proto, "kill", 5.0)
        out["will_on_hang"] = will_latency(broker.port, proto, "hang", 6.0)  # keepalive 2 s: due at ~3 s
        return out
    finally:
        broker.stop()


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="broker_fallback_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages (CI)")
    ap.add_argument("--candidates", default="mosquitto,iotcore,amqtt")
    ap.add_argument("--messages", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "broker_fallback.json"))
    args = ap.parse_args(argv)
    n = args.messages or (3_000 if args.quick else 20_000)
    deadline = 10.0 if args.quick else 30.0
    results: dict[str, Any] = {"messages": n, "versions": {
        "iotcore": _version("iotcore"), "amqtt": _version("amqtt"), "paho-mqtt": _version("paho-mqtt")}}
    with tempfile.TemporaryDirectory(prefix="fogline-fallback-") as tmp:
        for name in args.candidates.split(","):
            if name == "mosquitto" and find_mosquitto() is None:
                results[name] = {"error": "not installed"}
                continue
            if name in ("iotcore", "amqtt") and _version(name) is None:
                results[name] = {"error": f"not installed (pip install {name})"}
                continue
            results[name] = bench_one(name, Path(tmp), n, deadline)
    base = results.get("mosquitto", {}).get("qos1", {}).get("msg_per_s")
    if base:
        for name in ("iotcore", "amqtt"):
            rate = results.get(name, {}).get("qos1", {}).get("msg_per_s")
            if rate:
                results[name]["qos1"]["vs_mosquitto"] = round(rate / base, 3)
    emit("broker_fallback", results, path=Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

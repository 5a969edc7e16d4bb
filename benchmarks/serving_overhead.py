"""Overhead per request: Fogline's HTTPS OIP path over a 2-partition chain against a bare server.

Run: ``fogline bench serving-overhead [--quick]`` (or ``python -m benchmarks.serving_overhead``).
JSON on stdout and in ``out/bench/serving_overhead.json``; a summary on stderr. The lead's
``fogline bench serving`` calls ``run_overhead(quick)``.

Measured in one run, on this machine:

* **Fogline**: a secure site (``simulations.local_site.LocalSite``: ``fogline broker --http 0``,
  mosquitto with TLS and client certificates), two real agents in processes of their own (one
  onnxruntime thread each), each holding one partition of a 2-partition chain of YOLOv8n
  (``nudenet/320n.onnx``, the model ``fogline bench pipeline`` uses); requests over HTTPS with a
  client certificate, the Open Inference Protocol's binary tensor extension (and JSON tensors).
* **Bare**: a minimal aiohttp + onnxruntime server in a process of its own, the same TLS (the
  fog's server certificate, client certificates checked against the site CA), the whole model
  in one session with the same intra-op threads (1), the same request and response bodies.

Closed loop, one request at a time, the two servers interleaved request by request (both see
the same load); p50/p90/p99 per path, the p50 ratio Fogline / bare (issue 32's goal: <= 2x) and
the load average before and after.
"""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import run_header
from benchmarks.http_bench import OipConnection, latency, wait_for

__all__ = ["run_overhead", "main", "SHAPE"]

SHAPE = [1, 3, 320, 320]
SMALL_SHAPE = [1, 3, 32, 32]       # zoo:resnet, 0.4 ms whole: what a request costs beside the model
_INPUT = {"yolo": "images", "resnet": "x"}
_NAME = "serving_overhead"


# ---------------------------------------------------------------- the bare server (its own process)


def _bare_serve(models: dict[str, str], tls_dir: str, ca: str, threads: int, port_file: str) -> None:
    """aiohttp + onnxruntime, nothing else: parse the OIP body, run the whole model, answer."""
    import onnxruntime as ort
    from aiohttp import web

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sessions = {name: ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
                for name, path in models.items()}

    async def infer(request: web.Request) -> web.Response:
        sess = sessions[request.match_info["name"]]
        out_names = [o.name for o in sess.get_outputs()]
        body = await request.read()
        hl = request.headers.get("Inference-Header-Content-Length")
        head = json.loads(body[:int(hl)] if hl else body)
        feeds: dict[str, np.ndarray] = {}
        offset = int(hl) if hl else 0
        for t in head["inputs"]:
            size = t.get("parameters", {}).get("binary_data_size")
            if size is not None:
                arr = np.frombuffer(body, np.float32, size // 4, offset).reshape(t["shape"])
                offset += size
            else:
                arr = np.asarray(t["data"], np.float32).reshape(t["shape"])
            feeds[t["name"]] = arr
        outs = sess.run(None, feeds)
        binary = bool(head.get("parameters", {}).get("binary_data_output"))
        rows, blobs = [], []
        for name, y in zip(out_names, outs):
            row: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(y.shape)}
            if binary:
                b = np.ascontiguousarray(y, "<f4").tobytes()
                row["parameters"] = {"binary_data_size": len(b)}
                blobs.append(b)
            else:
                row["data"] = y.ravel().tolist()
            rows.append(row)
        doc = json.dumps({"model_name": request.match_info["name"], "model_version": "1",
                          "outputs": rows}, separators=(",", ":")).encode()
        if not binary:
            return web.Response(body=doc, content_type="application/json")
        return web.Response(body=b"".join([doc, *blobs]), content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(doc))})

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(Path(tls_dir) / "broker.pem"), str(Path(tls_dir) / "broker.key"))
    ctx.load_verify_locations(cafile=ca)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.set_alpn_protocols(["http/1.1"])

    async def serve() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v2/models/{name}/infer", infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    asyncio.run(serve())


def _spawn_bare(models: dict[str, str], tls_dir: Path, ca: str, tmp: Path,
                log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from runtime import children

    port_file = tmp / "bare.port"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    with open(log, "ab") as err:
        proc = children.spawn([sys.executable, "-m", "benchmarks.serving_overhead", "--bare-serve",
                               json.dumps([models, str(tls_dir), ca, 1, str(port_file)])],
                              env=env, stdout=subprocess.DEVNULL, stderr=err)
    port = wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 60, "bare server port")
    return proc, f"127.0.0.1:{port}"


# ---------------------------------------------------------------- the run


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _ratios(lat: dict[str, Any], ours: str, bare: str) -> dict[str, float]:
    return {f"{q}_ratio": round(lat[ours][f"{q}_ms"] / lat[bare][f"{q}_ms"], 3) for q in ("p50", "p90", "p99")}


def run_overhead(quick: bool, tmp: Path | None = None) -> dict[str, Any]:
    """The whole measurement (see the module doc); a dict for JSON."""
    if tmp is None:
        with tempfile.TemporaryDirectory(prefix="fogline-overhead-") as d:
            return run_overhead(quick, Path(d))
    from models import zoo
    from models.thirdparty import fetch
    from runtime import children
    from simulations.local_site import LocalSite

    rounds = 60 if quick else 300
    json_rounds = 8 if quick else 60
    path = fetch("nudenet", "nudenet/320n.onnx")
    out: dict[str, Any] = run_header(_NAME, quick, model="yolov8n (nudenet 320n.onnx)", input_shape=SHAPE,
                                     small_model="zoo:resnet", partitions=2, intra_op_threads=1,
                                     rounds=rounds, json_rounds=json_rounds)
    site = LocalSite(tmp / "fog", site="ovh", log=tmp / "fog.log",
                     args=["--http", "0", "--state-interval", "1", "--summary-interval", "1"]).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(site.spawn_agents([{"id": "cam", "memory": 1000, "flops": 1e8,
                                         "labels": {"role": "source", "power-domain": "pc"}}],
                                       tmp / "agents", tmp / "cam.log", host="127.0.0.1"))
        for i in range(2):
            procs.append(site.spawn_agents([{"id": f"w{i}", "memory": 200_000_000, "flops": 1e10,
                                             "labels": {"role": "ovh", "power-domain": f"pd{i}"}}],
                                           tmp / "agents", tmp / f"w{i}.log", host="127.0.0.1"))
        c = site.client()
        wait_for(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= {"cam", "w0", "w1"},
                 180, "agents alive", step=0.1)
        small = tmp / "resnet.onnx"
        small.write_bytes(zoo.build("resnet").SerializeToString())
        for name, model, shape in (("yolo", str(path), SHAPE), ("resnet", str(small), SMALL_SHAPE)):
            c.deploy({"name": name, "model": model, "source": "cam", "sink": "cam",
                      "input_shapes": {_INPUT[name]: shape}, "selectors": {"role": "ovh"},
                      "min_partitions": 2, "max_partitions": 2}, timeout=120)
            w = c.wait_running(name, 180)
            out[f"chain_{name}"] = [[p["segments"][0], p["segments"][1], p["device"]]
                                    for p in w["placement"][0]["partitions"]]
        creds = site.credentials("admin")
        ca, cert = str(creds / "ca.pem"), (str(creds / "cert.pem"), str(creds / "key.pem"))
        bare_proc, bare_addr = _spawn_bare({"yolo": str(path), "resnet": str(small)},
                                           tmp / "fog" / "pki" / "broker", ca, tmp, tmp / "bare.log")
        procs.append(bare_proc)
        fog = OipConnection(site.ready["http"], ca=ca, cert=cert)
        bare = OipConnection(bare_addr, ca=ca, cert=cert)
        rng = np.random.default_rng(0)
        xs = {"yolo": rng.random(SHAPE, dtype=np.float32), "resnet": rng.random(SMALL_SHAPE, dtype=np.float32)}

        def call(conn: OipConnection, name: str, binary: bool) -> Callable[[], object]:
            def go() -> object:
                st, y = conn.infer(name, xs[name], binary=binary, name=_INPUT[name])
                if st != 200:
                    raise RuntimeError(f"{name}: HTTP {st}: {str(y)[:200]}")
                return y
            return go

        for name in xs:
            out[f"answers_max_abs_diff_{name}"] = float(np.max(np.abs(
                np.asarray(call(fog, name, True)()) - np.asarray(call(bare, name, True)()))))
        out["load_before"] = _load()
        paths = {f"{who}_{name}_{kind}": call(conn, name, kind == "binary")
                 for name, kind in (("yolo", "binary"), ("resnet", "binary"), ("resnet", "json"))
                 for who, conn in (("fogline", fog), ("bare", bare))}
        lat = latency(paths, rounds, warmup=5 if quick else 20)
        lat.update(latency({f"{who}_yolo_json": call(conn, "yolo", False)
                            for who, conn in (("fogline", fog), ("bare", bare))}, json_rounds, warmup=2))
        out["load_after"] = _load()
        out["latency"] = lat
        out["ratios"] = {f"{name}_{kind}": _ratios(lat, f"fogline_{name}_{kind}", f"bare_{name}_{kind}")
                         for name, kind in (("yolo", "binary"), ("yolo", "json"), ("resnet", "binary"),
                                            ("resnet", "json"))}
        out["added_p50_ms"] = {k: round(lat[f"fogline_{k}"]["p50_ms"] - lat[f"bare_{k}"]["p50_ms"], 3)
                               for k in out["ratios"]}
        out["goal_p50_at_most_2x_bare"] = out["ratios"]["yolo_binary"]["p50_ratio"] <= 2.0
        fog.close()
        bare.close()
        c.close()
    finally:
        children.stop_all(procs, group=True)
        site.stop()
    return out


def _summary(r: dict[str, Any]) -> str:
    lat, ra = r["latency"], r["ratios"]
    return (f"OIP p50 over a 2-partition chain of YOLOv8n {lat['fogline_yolo_binary']['p50_ms']} ms vs bare "
            f"{lat['bare_yolo_binary']['p50_ms']} ms: {ra['yolo_binary']['p50_ratio']}x (goal <= 2x); JSON "
            f"{ra['yolo_json']['p50_ratio']}x; zoo:resnet {lat['fogline_resnet_binary']['p50_ms']} vs "
            f"{lat['bare_resnet_binary']['p50_ms']} ms ({ra['resnet_binary']['p50_ratio']}x, "
            f"+{r['added_p50_ms']['resnet_binary']} ms); load {r['load_before']} -> {r['load_after']}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--bare-serve"]:  # the baseline server's own process (see _spawn_bare)
        models, tls_dir, ca, threads, port_file = json.loads(args[1])
        _bare_serve(models, tls_dir, ca, int(threads), port_file)
        return 0
    from benchmarks._emit import quick_main
    return quick_main(_NAME, run_overhead, _summary, args, description=__doc__.splitlines()[0],
                      quick_help="60 interleaved requests per path (~1 min)")


if __name__ == "__main__":
    sys.exit(main())

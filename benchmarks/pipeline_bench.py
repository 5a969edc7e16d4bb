"""Benchmark: frames per second of a real third-party CNN split over two simulated devices.

YOLOv8n (``nudenet/320n.onnx`` from the pinned nudenet wheel, ``models.thirdparty``) runs
on a real secure site (``simulations.local_site.LocalSite``: the fog broker, mosquitto with
TLS) with real agents (``simulations.agent_group``), each worker in its own process (one
onnxruntime thread each). Simulated devices run the real partition and then sleep up to
the partition's FLOPs / the device's advertised FLOP/s, so a stage takes what the cost model
says when that exceeds the real compute.

Measured in the same run, on the same fleet:

- the throughput objective's 2-stage chain, one request at a time (``window=1``: the baseline,
  what Fogline did before) against ``window=W`` requests in flight (``FogClient.infer_many``);
- measured frames/s against the scheduler's prediction (``1 / bottleneck_s``);
- the latency objective's plan (placed and measured the same way) against the throughput one,
  and both plans' predictions from the cost model;
- compressed cuts: float16 under ``max_activation_error`` and int8 under
  ``min_top1_agreement``: bytes per frame at the cut, the fog's calibration error, and the
  answers' error and top-1 agreement against the model run whole, locally, in float32;
- a slow link between the two stages (``--slow-link`` bit/s, shaped by the kernel:
  ``simulations.netshape``, each stage's agent in a network namespace of its own with ``tbf``
  on its veth pair; the first stage's uplink and the second's downlink are slow, the frame's
  way in and the answer's way out are not): frames/s of float32, float16 and int8 cuts on that
  same link, each against the scheduler's prediction, and the gain over float32;
- a ``kill -9`` of one stage's device mid-stream (``--kill-only`` alone): the throughput plan with
  2 replicas over 4 simulated workers, frames streamed pipelined (``FogClient.stream_results``):
  frames lost (none may be) and in order, frames/s before the kill (the baseline), the longest
  gap between answers after it, and when frames/s is back to 90 % of the baseline (1 s windows).

Run: ``python -m benchmarks.pipeline_bench [--quick] [--slow-link-only | --kill-only]`` (or
``fogline bench pipeline``).
JSON on stdout and in out/bench/pipeline.json.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import emit
from runtime import children

SHAPE = [1, 3, 320, 320]


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(f"{what} not within {timeout:g} s")


def _row(c: Any, name: str) -> dict[str, Any]:
    return next(w for w in c.status(limit=0)["workloads"] if w["name"] == name)


def _fps(c: Any, name: str, frames: list[dict[str, np.ndarray]], window: int
         ) -> tuple[float, list[dict[str, np.ndarray]]]:
    c.infer_many(name, frames[:2], window=1, timeout=30)  # warm: sessions, routes, connections
    t0 = time.perf_counter()
    outs = c.infer_many(name, frames, window=window, timeout=30)
    return len(frames) / (time.perf_counter() - t0), outs


def _plans(path: Path, flops: float, link: float) -> dict[str, Any]:
    """Both objectives' plans for the bench fleet under the cost model (offline, same profile)."""
    from fog_broker.placement import ChainProfile, Device, Fleet, Workload, chain_cost, schedule
    from models.cuts import chain_profile
    from models.probe import analyze

    prof = ChainProfile.from_dict(chain_profile(analyze(path, input_shapes={"images": SHAPE}), 16,
                                                strategy="balanced").to_dict())
    common: dict[str, Any] = dict(uplink_bps=link, downlink_bps=link, rtt_s=0.001, power_active_w=5.0, power_idle_w=0.0,
                  tx_j_per_byte=1e-8, rx_j_per_byte=1e-8)
    devs = (Device(id="cam", flops=1e8, memory_bytes=1000, labels={"role": "source"}, **common),
            *(Device(id=f"w{i}", flops=flops, memory_bytes=200_000_000,
                     labels={"role": "worker", "power-domain": f"pd{i}"}, **common)
              for i in range(2)))
    out: dict[str, Any] = {"segments": len(prof.segments),
                           "flops": sum(s.flops for s in prof.segments)}
    for obj in ("latency", "throughput"):
        w = Workload(obj, "cam", "cam", objective=obj, profile=prof,
                     selectors=(("role", "worker"),))
        r = schedule(Fleet(devs), [w]).result(obj)
        rep = r.replicas[0]
        cc = chain_cost(prof, rep.partitions, {d.id: d for d in devs}, "cam", "cam")
        out[obj] = {"partitions": [[p.first, p.last, p.device] for p in rep.partitions],
                    "predicted_latency_s": round(cc.latency_s, 4),
                    "predicted_fps": round(1.0 / cc.bottleneck_s, 3)}
    return out


def _compare(outs: list[dict[str, np.ndarray]], refs: list[np.ndarray]) -> dict[str, float]:
    errs, agree = [], []
    for o, r in zip(outs, refs):
        y = next(iter(o.values()))
        errs.append(float(np.linalg.norm(y - r) / np.linalg.norm(r)))
        agree.append(int(np.argmax(y)) == int(np.argmax(r)))
    return {"answer_rel_error_max": float(max(errs)), "answer_top1_agreement": float(np.mean(agree))}


_FAST = 1e9


def _slow_rates(bps: float) -> list[tuple[float, float]]:
    """(up, down) of each stage's link: stage 0's uplink and stage 1's downlink run at ``bps``
    (the cut crosses both, through the fog's mosquitto); the frame's way in and the answer's
    way out are fast."""
    return [(bps, _FAST), (_FAST, bps)]


def _advertised_fps(stages: list[dict[str, Any]], rates: dict[str, tuple[float, float]]
                    ) -> float | None:
    """1 / the slowest stage, each link's serialisation at the advertised rates (the fog's live
    figure uses the agents' own uplink estimates, which queued frames bias low)."""
    times = []
    for st in stages:
        if st["stage"].startswith("link "):
            a, z = st["stage"][5:].split("->")
            times.append(8.0 * st["bytes_per_frame"] / min(rates[a][0], rates[z][1]))
        else:
            times.append(st["predicted_s"])
    return 1.0 / max(times) if times and max(times) > 0 else None


def _slow_link_agents(site: Any, tmp: Path, args: argparse.Namespace, links: list[Any]
                      ) -> list[subprocess.Popen[bytes]]:
    """Two simulated workers, each in its link's namespace, reaching the fog over its veth pair."""
    groups: list[subprocess.Popen[bytes]] = []
    for i, (link, (up, down)) in enumerate(zip(links, _slow_rates(args.slow_link))):
        w = {"id": f"slow{i}", "memory": 200_000_000, "flops": args.flops, "model_compute": True,
             "uplink_bps": up, "downlink_bps": down,
             "labels": {"role": "slow", "power-domain": f"slow{i}"}}
        groups.append(site.spawn_agents([w], tmp / "agents", tmp / f"slow{i}.log",
                                        host=link.host_ip, wrap=link.wrap))
    return groups


def kill_figures(answers: Sequence[float], first: float, killed_at: float, stop_at: float,
                 window_s: float = 1.0, share: float = 0.9) -> dict[str, float | None]:
    """The kill phase's figures from the answers' arrival times (monotonic s, ascending).

    ``first`` is the first answer, ``stop_at`` when the last frame was sent. Frames/s before the
    kill counts the answers after ``first`` up to the kill; the rate is back at the end of the
    first ``window_s`` window wholly after the kill that holds >= ``share`` of it (so never
    sooner than ``window_s``: a window reaching back before the kill would hide a stall).
    """
    before = sum(1 for t in answers if first < t <= killed_at) / (killed_at - first)
    after = [t for t in answers if t > killed_at]
    gaps = [b - a for a, b in pairwise([killed_at, *after])]
    back = next((end for end in (killed_at + window_s, *after)
                 if killed_at + window_s <= end <= stop_at
                 and sum(1 for t in after if end - window_s < t <= end) >= share * before * window_s),
                None)
    fps_back = (sum(1 for t in after if back < t <= stop_at) / (stop_at - back)
                if back is not None and stop_at > back else None)
    return {"fps_before_kill": before, "max_gap_after_kill_s": max(gaps, default=None),
            "rate_back_after_s": None if back is None else back - killed_at,
            "fps_after_recovery": fps_back}


def _kill_phase(site: Any, c: Any, tmp: Path, args: argparse.Namespace, base: dict[str, Any],
                frames: list[dict[str, np.ndarray]], refs: list[np.ndarray],
                groups: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """The throughput plan with 2 replicas over 4 simulated workers, each its own process, frames
    streamed pipelined; ``kill -9`` of the process group of replica 0's last stage's device after
    ``--kill-pre`` s of answers, then ``--kill-post`` s more frames. Lost: frames the client sent
    (each given a request id) without an answer; in order: each answer is its own frame's (within
    1e-3 of the whole model's answer; neighbouring frames' answers differ by far more)."""
    import signal

    from fog_broker.client import InferenceError
    from runtime.errors import LocalViolation

    ids = [f"kill{i}" for i in range(4)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for d in ids:
        w = {"id": d, "memory": 200_000_000, "flops": args.flops, "link_bps": args.link,
             "model_compute": True, "labels": {"role": "kill", "power-domain": d}}
        procs[d] = site.spawn_agents([w], tmp / "agents", tmp / f"{d}.log", host="127.0.0.1")
        groups.append(procs[d])
    _wait(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= set(ids), 180,
          "kill-phase agents alive")
    c.deploy({"name": "kill9", **base, "selectors": {"role": "kill"}, "objective": "throughput",
              "replicas": 2, "min_partitions": 2, "max_partitions": 2}, timeout=120)
    w = c.wait_running("kill9", 180)
    rep0 = next(r for r in w["placement"] if r["replica"] == 0)
    victim = rep0["partitions"][-1]["device"]
    c.infer_many("kill9", frames[:4], window=2, timeout=30)  # warm both chains
    sent, first, killed_at, stop_at = 0, 0.0, 0.0, float("inf")

    def feed() -> Any:
        nonlocal sent
        while time.monotonic() < stop_at:
            sent += 1
            yield frames[(sent - 1) % len(frames)]

    times: list[float] = []
    oks, errs = 0, []
    error = None
    try:
        for k, res in enumerate(c.stream_results("kill9", feed(), window=args.window, timeout=30)):
            now = time.monotonic()
            times.append(now)
            if res.ok:
                oks += 1
                y, r = next(iter(res.tensors.values())), refs[k % len(refs)]
                errs.append(float(np.linalg.norm(y - r) / np.linalg.norm(r)))
            if not first:
                first = now
            elif not killed_at and now - first >= args.kill_pre:
                killed_at = time.monotonic()
                os.killpg(procs[victim].pid, signal.SIGKILL)
                stop_at = killed_at + args.kill_post
    except (InferenceError, LocalViolation, TimeoutError) as exc:  # unanswered: counted as lost
        error = str(exc)
    after = _row(c, "kill9")
    c.delete("kill9")
    figs = kill_figures(times, first, killed_at, stop_at) if killed_at else {}
    return {"replicas": 2, "workers": ids, "window": args.window,
            "partitions": {r["replica"]: [p["device"] for p in r["partitions"]]
                           for r in w["placement"]},
            "killed": f"{victim} (replica 0, last stage), kill -9 of its process group",
            "frames_sent": sent, "answered_ok": oks, "lost": sent - len(times), "error": error,
            "in_order": len(errs) == len(times) and max(errs, default=1.0) < 1e-3,
            "answer_rel_error_max": max(errs, default=None),
            "neighbour_rel_diff_min": min((float(np.linalg.norm(a - b) / np.linalg.norm(a))
                                           for a, b in pairwise(refs)), default=None),
            "before_s": args.kill_pre, "after_s": args.kill_post,
            **{k: None if v is None else round(v, 3) for k, v in figs.items()},
            "healthy_replicas_after": after["healthy_replicas"],
            "rate_back_means": "end of the first 1 s window wholly after the kill with >= 90 % of "
                               "the frames/s before it (>= 1 s by construction)"}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import onnxruntime as ort

    from models.thirdparty import fetch
    from simulations.local_site import LocalSite

    path = Path(args.model) if args.model else fetch("nudenet", "nudenet/320n.onnx")
    rng = np.random.default_rng(0)
    frames = [{"images": rng.random(SHAPE, dtype=np.float32)} for _ in range(args.frames)]
    serial_frames = frames[:args.serial]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    whole = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    whole.run(None, frames[0])
    t0 = time.perf_counter()
    refs = [np.asarray(whole.run(None, f)[0]) for f in frames]
    local_s = (time.perf_counter() - t0) / len(frames)
    del whole

    res: dict[str, Any] = {"model": "yolov8n (nudenet 320n.onnx)" if not args.model else str(path),
                           "input_shape": SHAPE, "window": args.window,
                           "frames": args.frames, "serial_frames": args.serial,
                           "device_flops": args.flops, "device_link_bps": args.link,
                           "whole_model_local_1_thread_s": round(local_s, 4)}
    rest = not (args.slow_link_only or args.kill_only)  # the phases before the slow link
    if rest:
        res["plans_cost_model"] = _plans(path, args.flops, args.link)
    from simulations.netshape import NetShape

    why = ("--kill-only" if args.kill_only else
           NetShape.probe() if args.slow_link else "--slow-link 0")
    shape = NetShape()
    # links slow from the start, deploys included: the fog's deploy ack window covers shipping a
    # partition (~6 MB) over the downlink the agent advertises
    links = [shape.add(up, down) for up, down in _slow_rates(args.slow_link)] if why is None else []
    # agents in other namespaces reach the fog over their veth pair: it listens on every address
    # and its certificate names the host end of each pair
    san = [a for link in links for a in ("--san", link.host_ip)]
    site = LocalSite(tmp / "fog", site="pipe", log=tmp / "fog.log",
                     host="0.0.0.0" if links else "127.0.0.1",
                     args=["--state-interval", "1", "--startup-wait", "2",
                           "--summary-interval", "1", *san])
    try:
        site.start()
    except BaseException:
        shape.close()
        raise
    groups: list[subprocess.Popen[bytes]] = []
    try:
        cam = {"id": "cam", "memory": 1000, "flops": 1e8, "link_bps": args.link,
               "labels": {"role": "source", "power-domain": "pc"}}
        groups.append(site.spawn_agents([cam], tmp / "agents", tmp / "cam.log", host="127.0.0.1"))
        want = {"cam"}
        if why is None:
            groups += _slow_link_agents(site, tmp, args, links)
            want |= {"slow0", "slow1"}
        # each worker its own process: two stages on two cores. "sim": a stage takes at least
        # its FLOPs / the advertised FLOP/s (the cost model's device); "real": what the CPU takes.
        for mode in ("sim", "real") if rest else ():
            want |= {f"{mode}0", f"{mode}1"}
            for i in range(2):
                w = {"id": f"{mode}{i}", "memory": 200_000_000, "flops": args.flops,
                     "link_bps": args.link, "model_compute": mode == "sim",
                     "labels": {"role": mode, "power-domain": f"{mode}{i}"}}
                groups.append(site.spawn_agents([w], tmp / "agents", tmp / f"{mode}{i}.log",
                                                host="127.0.0.1"))
        c = site.client()
        _wait(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= want,
              180, "agents alive")
        base = {"model": str(path), "source": "cam", "sink": "cam",
                "input_shapes": {"images": SHAPE}}

        def deploy(name: str, mode: str, **kw: Any) -> dict[str, Any]:
            c.deploy({"name": name, **base, "selectors": {"role": mode}, **kw}, timeout=120)
            c.wait_running(name, 180)
            return _row(c, name)

        def parts(w: dict[str, Any]) -> list[list[Any]]:
            return [[p["segments"][0], p["segments"][1], p["device"]]
                    for p in w["placement"][0]["partitions"]]

        for mode in ("sim", "real") if rest else ():
            # 1. throughput objective: one at a time (the baseline) vs pipelined
            deploy(f"thr-{mode}", mode, objective="throughput", min_partitions=2,
                   max_partitions=2)
            serial_fps, _ = _fps(c, f"thr-{mode}", serial_frames, 1)
            pipe_fps, outs = _fps(c, f"thr-{mode}", frames, args.window)
            w = _row(c, f"thr-{mode}")
            pred = w["throughput"]["predicted_fps"]
            res[f"throughput_plan_{mode}"] = {
                "partitions": parts(w), "predicted_fps": round(pred, 3) if pred else None,
                "predicted_latency_s": w["placement"][0]["latency_s"],
                "serial_fps": round(serial_fps, 3), "pipelined_fps": round(pipe_fps, 3),
                "speedup": round(pipe_fps / serial_fps, 3),
                "measured_vs_predicted": round(pipe_fps / pred - 1, 4) if pred else None,
                **_compare(outs, refs)}
            c.delete(f"thr-{mode}")
            # 2. the latency objective's plan on the same fleet, measured the same way
            w = deploy(f"lat-{mode}", mode, objective="latency")
            lat_serial, _ = _fps(c, f"lat-{mode}", serial_frames, 1)
            lat_pipe, _ = _fps(c, f"lat-{mode}", frames, args.window)
            res[f"latency_plan_{mode}"] = {
                "partitions": parts(w), "predicted_latency_s": w["placement"][0]["latency_s"],
                "serial_fps": round(lat_serial, 3), "pipelined_fps": round(lat_pipe, 3)}
            c.delete(f"lat-{mode}")
        # 3. compressed cuts (simulated devices)
        comp: dict[str, Any] = {}
        for name, bound in () if not rest else (
                ("float16", {"max_activation_error": 1e-3}), ("int8", {"min_top1_agreement": 0.99})):
            w = deploy(name, "sim", objective="throughput", min_partitions=2, max_partitions=2,
                       **bound)

            def wires(name: str = name) -> Any:
                return _row(c, name)["placement"][0]["activations"]
            acts = _wait(wires, 180, f"{name} wires chosen")
            fps, outs = _fps(c, name, frames, args.window)
            cut = acts["cuts"][0]
            comp[name] = {"bound": bound, "partitions": parts(w), "wire": cut["wire"],
                          "note": cut.get("note"),
                          "float32_bytes_per_frame": cut["float32_bytes"],
                          "wire_bytes_per_frame": cut["wire_bytes"],
                          "bytes_ratio": round(cut["float32_bytes"] / max(1, cut["wire_bytes"]), 3),
                          "calibration_rel_error": cut["rel_error"],
                          "calibration_top1": acts.get("top1_agreement"),
                          "pipelined_fps": round(fps, 3), **_compare(outs, refs)}
            c.delete(name)
        if comp:
            res["compressed_cuts"] = comp
        # 4. the same chain on a slow link: float32 (the baseline), float16 and int8 cuts
        slow: dict[str, Any] = {"link_bps": args.slow_link, "frames": args.slow_frames,
                                "window": args.slow_window,
                                "unavailable": why}
        if why is None:
            slow["shaped_by"] = ("tbf on veth pairs into per-agent network namespaces (kernel), "
                                 "shaped before deploying")
            slow["netem"] = NetShape.has_netem()  # delay/loss: not on this kernel when False
            for name, bound in (("float32", {}), ("float16", {"max_activation_error": 1e-3}),
                                ("int8", {"min_top1_agreement": 0.99})):
                wname = f"slow-{name}"
                w = deploy(wname, "slow", objective="throughput", min_partitions=2,
                           max_partitions=2, **bound)

                def cut_wires(wname: str = wname) -> Any:
                    return _row(c, wname)["placement"][0]["activations"]
                cut = _wait(cut_wires, 180, f"{wname} wires chosen")["cuts"][0] if bound else {}
                fps, outs = _fps(c, wname, frames[:args.slow_frames], args.slow_window)
                w = _row(c, wname)
                pred = w["throughput"]["predicted_fps"]
                rates = {"cam": (args.link, args.link),
                         **{f"slow{i}": r for i, r in enumerate(_slow_rates(args.slow_link))}}
                adv = _advertised_fps(w["placement"][0].get("stages") or [], rates)
                slow[name] = {"predicted_fps_advertised_links": round(adv, 3) if adv else None,
                              "measured_vs_advertised": round(fps / adv - 1, 4) if adv else None,
                              "partitions": parts(w), "measured_on": w.get("measured_on"),
                              "stages": w["placement"][0].get("stages"),
                              "bottleneck": w["placement"][0].get("bottleneck"),
                              "wire": cut.get("wire", "float32"),
                              "note": cut.get("note"),
                              "wire_bytes_per_frame": cut.get("wire_bytes"),
                              "predicted_fps": round(pred, 3) if pred else None,
                              "pipelined_fps": round(fps, 3),
                              "measured_vs_predicted": round(fps / pred - 1, 4) if pred else None,
                              **_compare(outs, refs[:args.slow_frames])}
                c.delete(wname)
            base_fps = slow["float32"]["pipelined_fps"]
            for name in ("float16", "int8"):
                slow[name]["fps_gain_vs_float32"] = round(slow[name]["pipelined_fps"] / base_fps, 3)
        res["slow_link"] = slow
        if not args.slow_link_only:  # 5. kill -9 of one stage's device mid-stream
            res["kill9"] = _kill_phase(site, c, tmp, args, base, frames, refs, groups)
        c.close()
    finally:
        children.stop_all(groups, 10.0)
        site.kill()
        shape.close()
    return res


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.cliargs import existing_file, nonneg_float, positive_float, positive_int

    ap = argparse.ArgumentParser(prog="pipeline_bench")
    ap.add_argument("--quick", action="store_true", help="fewer frames (~1.5 min)")
    ap.add_argument("--frames", type=positive_int, default=60, help="frames per pipelined measurement")
    ap.add_argument("--serial", type=positive_int, default=24, help="frames of the one-at-a-time baseline")
    ap.add_argument("--window", type=positive_int, default=8, help="requests in flight when pipelined")
    ap.add_argument("--flops", type=positive_float, default=1e10, help="each worker's advertised FLOP/s")
    ap.add_argument("--link", type=positive_float, default=1e9, help="each device's advertised bit/s")
    ap.add_argument("--slow-link", type=nonneg_float, default=10e6,
                    help="bit/s of the shaped link between the stages (0: skip that part)")
    ap.add_argument("--slow-frames", type=positive_int, default=20, help="frames per slow-link measurement")
    ap.add_argument("--slow-window", type=positive_int, default=4,
                    help="requests in flight on the slow link (a deeper queue on a saturated uplink "
                         "holds the agent's heartbeats back too: the fog may declare it lost)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--slow-link-only", action="store_true",
                      help="only the slow-link part (float32 vs float16 vs int8 on one link)")
    only.add_argument("--kill-only", action="store_true",
                      help="only the kill part (kill -9 of a stage's device mid-stream)")
    ap.add_argument("--kill-pre", type=positive_float, default=6.0,
                    help="seconds of answers before the kill (its frames/s baseline)")
    ap.add_argument("--kill-post", type=positive_float, default=12.0,
                    help="seconds frames are sent after the kill")
    ap.add_argument("--model", type=existing_file, help="another ONNX file with one 'images' input (default YOLOv8n)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.frames, args.serial = min(args.frames, 24), min(args.serial, 10)
        args.slow_frames = min(args.slow_frames, 12)
        args.kill_pre, args.kill_post = min(args.kill_pre, 4.0), min(args.kill_post, 8.0)
    out: dict[str, Any] = {"benchmark": "pipeline", "quick": args.quick, "cpu_count": os.cpu_count(),
                           "loadavg_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as d:
        out.update(run(args, Path(d)))
    emit("pipeline", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

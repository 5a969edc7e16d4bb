"""The autoscaling phase of ``fogline bench serving`` (issue 33): a step in offered load.

The same secure site (``serving_load``) and simulated workers as ``serving_bench`` (each worker its own process,
its own power domain), seven workers so three replica chains of two stages fit, and the CNN
deployed with ``"autoscale": {"min_replicas": 1, "max_replicas": 3}`` instead of ``replicas``.
One chain's capacity is measured first (closed loop); then the offered load steps, open loop
(Poisson) over HTTPS OIP with the 1 s SLO: 0.5x one chain, 2.5x, 0.5x again. A thread polls
``fogline status`` every half second for replicas wanted and running.

Reported: when the second (and third) chain ran after the step up, goodput over the offered
rate in the last 20 s of the step, when the site was back to one chain after the step down,
every answer that was neither a 200 nor a refusal (503) across the scale events, and a PNG
(``out/bench/serving_autoscale.png``): offered, goodput and replicas over time.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from runtime import children

from .serving_load import Load, start_site, wait_until

WORKERS = 7
UP_S = 20.0     # the acceptance: a second chain runs within this after the step up
DOWN_S = 90.0   # ... and one chain again within this after the step down


def _fleet(site: Any, tmp: Path, flops: float) -> list[subprocess.Popen[bytes]]:
    tmp.mkdir(parents=True, exist_ok=True)
    devs = [{"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pc"}}]
    groups = [site.spawn_agents(devs, tmp / "agents", tmp / "cam.log", host="127.0.0.1")]
    for i in range(WORKERS):
        w = {"id": f"w{i}", "memory": 200_000_000, "flops": flops, "link_bps": 1e9, "model_compute": True,
             "labels": {"role": "worker", "power-domain": f"pd{i}"}}
        groups.append(site.spawn_agents([w], tmp / "agents", tmp / f"w{i}.log", host="127.0.0.1"))
    return groups


class _Watch(threading.Thread):
    """Replicas wanted and running, sampled from ``fogline status`` (its own client)."""

    def __init__(self, site: Any) -> None:
        super().__init__(daemon=True)
        self.client = site.client()
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, wanted, running)
        self.events: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                w = next(x for x in self.client.status(limit=0)["workloads"] if x["name"] == "cnn")
                sc = w.get("scaling") or {}
                self.samples.append((time.monotonic(), int(sc.get("replicas_wanted", 0)),
                                     int(w.get("healthy_replicas", 0))))
                self.events = sc.get("events", self.events)
            except Exception:  # noqa: BLE001 - a missed sample under load is a gap in the plot
                pass
            self.stop.wait(0.5)


def _first(samples: list[tuple[float, int, int]], after: float, pred: Any) -> float | None:
    return next((t - after for t, want, run in samples if t >= after and pred(want, run)), None)


def run(args: Any, tmp: Path, model: Path, x: np.ndarray, capacity: float) -> dict[str, Any]:
    """One autoscaling run; ``args`` as ``serving_bench``'s (``flops``, ``slo``, ``quick``), ``capacity``
    one chain's frames/s as the serving phases measured it (measuring it here, closed loop on the
    autoscaled workload, would itself scale it up)."""
    slo = args.slo
    low_s, high_s, down_s = (15.0, 40.0, 100.0) if args.quick else (30.0, 60.0, 110.0)
    site = start_site(tmp, "auto", False)
    groups: list[subprocess.Popen[bytes]] = []
    watch: _Watch | None = None
    out: dict[str, Any] = {"workers": WORKERS, "steps_s": [low_s, high_s, down_s]}
    try:
        groups = _fleet(site, tmp / "auto-fleet", args.flops)
        c = site.client()
        want = {"cam", *(f"w{i}" for i in range(WORKERS))}
        wait_until(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= want, 180, "agents alive")
        c.deploy({"name": "cnn", "model": str(model), "source": "cam", "sink": "cam",
                  "autoscale": {"min_replicas": 1, "max_replicas": 3, "target_utilization": 0.7},
                  "objective": "throughput", "min_partitions": 2, "max_partitions": 2,
                  "selectors": {"role": "worker"}, "slo_s": slo}, timeout=120)
        c.wait_running("cnn", 180)
        out["one_chain_capacity_fps"] = round(capacity, 2)
        creds = site.issue("bench-auto", "app")
        load = Load(site.ready["http"], "cnn", x, str(creds / "ca.pem"),
                    (str(creds / "cert.pem"), str(creds / "key.pem")), slo)
        watch = _Watch(site)
        watch.start()
        t0 = time.monotonic()
        rows: list[dict[str, Any]] = []
        marks = {}
        for name, mult, dur, seed in (("low", 0.5, low_s, 11), ("high", 2.5, high_s, 12), ("down", 0.5, down_s, 13)):
            marks[name] = time.monotonic()
            for r in load.run(mult * capacity, dur, seed=seed):
                r["phase"] = name
                rows.append(r)
        marks["end"] = time.monotonic()
        watch.stop.set()
        watch.join(5)
        up, down = marks["high"], marks["down"]
        second = _first(watch.samples, up, lambda w, r: r >= 2)
        third = _first(watch.samples, up, lambda w, r: r >= 3)
        back = _first(watch.samples, down, lambda w, r: r <= 1 and w <= 1)
        tail = [r for r in rows if r["phase"] == "high" and r["sent"] >= up + high_s - 20.0]
        good = [r for r in tail if r["status"] == 200 and r["latency"] <= slo]
        bad = [r for r in rows if r["status"] not in (200, 503)]
        peak = max((w for _, w, _ in watch.samples), default=0)
        out.update({
            "offered_high_rps": round(2.5 * capacity, 2),
            "second_chain_running_after_s": None if second is None else round(second, 1),
            "third_chain_running_after_s": None if third is None else round(third, 1),
            "peak_replicas_wanted": peak,
            "goodput_over_offered_last_20s_of_step": round(len(good) / len(tail), 3) if tail else None,
            "one_chain_again_after_step_down_s": None if back is None else round(back, 1),
            "answers_not_200_or_503": len(bad),
            "errors_top": sorted({str(r.get("error", r["status"]))[:90] for r in bad})[:3],
            # when each failed answer was sent, against the step times (a scale event near it?)
            "failed_sent_at_s": [round(r["sent"] - t0, 1) for r in bad][:20],
            "step_up_at_s": round(up - t0, 1), "step_down_at_s": round(down - t0, 1),
            "requests": len(rows),
            "scale_events": watch.events,
            "loadavg": round(os.getloadavg()[0], 2),
        })
        out["targets"] = {
            "second_chain_within_20s": second is not None and second <= UP_S,
            "goodput_ge_0.9_offered_last_20s": (out["goodput_over_offered_last_20s_of_step"] or 0) >= 0.9,
            "one_chain_within_90s_of_step_down": back is not None and back <= DOWN_S,
            "no_failed_or_wrong_answer": not bad,
        }
        out["plot"] = _plot(rows, watch.samples, t0, marks, slo)
        c.close()
    finally:
        if watch is not None:
            watch.stop.set()
        children.stop_all(groups, 10.0)
        site.kill()
    return out


def _plot(rows: list[dict[str, Any]], samples: list[tuple[float, int, int]], t0: float,
          marks: dict[str, float], slo: float) -> str | None:
    """Offered and goodput per second, replicas wanted and running: out/bench/serving_autoscale.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from benchmarks._emit import OUT_DIR

    end = max((r["sent"] - t0 for r in rows), default=0.0)
    bins = np.arange(0.0, end + 2.0, 2.0)
    sent = np.array([r["sent"] - t0 for r in rows])
    good = np.array([r["sent"] - t0 for r in rows if r["status"] == 200 and r["latency"] <= slo])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(bins[:-1], np.histogram(sent, bins)[0] / 2.0, label="offered (req/s)", color="0.5")
    ax.plot(bins[:-1], np.histogram(good, bins)[0] / 2.0, label="goodput (req/s, within the SLO)", color="tab:green")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests per second")
    ax2 = ax.twinx()
    ax2.step([t - t0 for t, _, _ in samples], [w for _, w, _ in samples], where="post", color="tab:orange",
             label="replicas wanted")
    ax2.step([t - t0 for t, _, _ in samples], [r for _, _, r in samples], where="post", color="tab:blue",
             label="replicas running")
    ax2.set_ylabel("replica chains")
    ax2.set_ylim(0, 4)
    for name in ("high", "down"):
        ax.axvline(marks[name] - t0, color="k", linestyle=":", linewidth=1)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("autoscaling: a step from 0.5x to 2.5x one chain's capacity and back")
    fig.tight_layout()
    dest = OUT_DIR / "serving_autoscale.png"
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=100)
    plt.close(fig)
    return str(dest)


__all__ = ["run"]

"""The demo's report: a short table for people, PNG plots, JSON for scripts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["print_report", "write_plots"]


def print_report(result: dict[str, Any]) -> None:
    c = result.get("counters", {})
    fed = result.get("federated", {})
    hist = fed.get("history", [])
    sec = result.get("security", {})
    rel = result.get("release", {})
    rows = [
        ("site security", f"TLS + client certificates + ACL, devices enrolled by token (CA {str(sec.get('ca_sha256', '?'))[:12]}...)"
         if sec.get("tls") else "INSECURE (plain MQTT)"),
        ("devices", str(len(result.get("devices", [])))),
        ("deploy (3 partitions x 2 replicas)", f"{result.get('deploy_s', '?')} s to running"),
        ("requests sent / answered / lost", f"{c.get('requests_sent', 0)} / {c.get('requests_answered', 0)} / "
                                            f"{c.get('requests_lost', 0)}"),
        ("request errors / wrong outputs", f"{c.get('requests_failed', 0)} / {c.get('outputs_mismatched', 0)}"),
        ("max |output - monolithic|", f"{result.get('max_abs_diff', float('nan')):.2e}"),
        ("federated rounds completed", f"{c.get('rounds_completed', 0)} (rule {fed.get('rule', '?')})"),
        ("final accuracy", f"{hist[-1]['accuracy']:.3f}" if hist and "accuracy" in hist[-1] else "?"),
        ("faults injected / recoveries", f"{c.get('faults_injected', 0)} / {c.get('recoveries', 0)}"),
    ]
    for rec in result.get("recoveries", []):
        detail = ", ".join(f"{k} {v}" for k, v in rec.items() if k != "fault")
        rows.append((f"recovery: {rec['fault']}", detail))
    rows.append(("model releases (versions)", ", ".join(str(v) for v in fed.get("releases", [])) or "none"))
    if rel:
        rows.append(("released CNN served as partitions", f"v{rel.get('release_version')}: {rel.get('checked')} "
                     f"predictions, agreement with torch {rel.get('agreement', 0):.0%}"))
    rows.append(("elapsed", f"{result.get('elapsed_s', '?')} s"))
    rows.append(("verdict", "OK" if result.get("ok") else "FAILED"))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Fogline demo")
        table.add_column("what")
        table.add_column("result")
        for k, v in rows:
            table.add_row(k, v)
        Console().print(table)
    except ImportError:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    # placement map: devices x (replica, partition), before and after the fault
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    devices = [d["id"] for d in result.get("devices", [])]
    killed = {f["target"] for f in result.get("faults", []) if f["kind"] == "kill -9 device"}
    for ax, key, title in ((axes[0], "placement", "placement"), (axes[1], "placement_after", "after the kill")):
        for r in result.get(key, []) or []:
            for p in r["partitions"]:
                if p["device"] in devices:
                    y = devices.index(p["device"])
                    ax.barh(y, 1, left=p["index"] + 4 * r["replica"], color=f"C{r['replica']}", edgecolor="k")
                    ax.text(p["index"] + 4 * r["replica"] + 0.5, y, f"r{r['replica']}p{p['index']}",
                            ha="center", va="center", fontsize=8, color="w")
        ax.set_yticks(range(len(devices)))
        ax.set_yticklabels([d + ("  (killed)" if d in killed else "") for d in devices], fontsize=8)
        ax.set_xticks([1.5, 5.5])
        ax.set_xticklabels(["replica 0", "replica 1"])
        ax.set_title(title)
    fig.suptitle("Partition placement (residual CNN, 3 partitions x 2 replicas)")
    fig.tight_layout()
    paths.append(out / "placement.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # latency over time with the fault marked
    tl = result.get("timeline", [])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bad = [(e["t"], 1e3 * e["latency_s"]) for e in tl if e.get("latency_s") is not None and not e["ok"]]
    for rep in sorted({e.get("replica", 0) for e in tl if e["ok"]}):
        pts = [(e["t"], 1e3 * e["latency_s"]) for e in tl
               if e.get("latency_s") is not None and e["ok"] and e.get("replica", 0) == rep]
        if pts:
            ax.plot(*zip(*pts), ".", ms=4, color=f"C{rep}", label=f"answered by replica {rep}")
    if bad:
        ax.plot(*zip(*bad), "x", color="r", label="error")
    for f in result.get("faults", []):
        if f["kind"] == "kill -9 device":
            ax.axvline(f["at_s"], color="r", ls="--", label=f"kill -9 {f['target']}")
    ax.set_xlabel("time since demo start (s)")
    ax.set_ylabel("request latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Inference latency through the partition chain")
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # accuracy per round with the coordinator crash marked
    fed = result.get("federated", {})
    hist = fed.get("history", [])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    rounds = [h.get("round", i + 1) for i, h in enumerate(hist)]
    accs = [h.get("accuracy") for h in hist]
    ax.plot(rounds, accs, "o-", label=f"{fed.get('rule', '')} with Byzantine clients")
    if fed.get("killed_after_round"):
        ax.axvline(fed["killed_after_round"] + 0.5, color="r", ls="--", label="coordinator kill -9 + resume")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Federated training (PyTorch CNN app, digits)")
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

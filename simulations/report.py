"""The demo's report: a short table for people, PNG plots, JSON for scripts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["print_report", "site_rows", "step_rows", "write_plots"]


def print_report(result: dict[str, Any]) -> None:
    c = result.get("counters", {})
    fed = result.get("federated", {})
    hist = fed.get("history", [])
    sec = result.get("security", {})
    rel = result.get("release", {})
    sites = result.get("sites", {})
    cas = ", ".join(f"{n} {str(v.get('ca_sha256', '?'))[:12]}..." for n, v in sec.get("sites", {}).items()) or \
        f"{str(sec.get('ca_sha256', '?'))[:12]}..."
    per_site = ", ".join(f"{len(v.get('devices', []))} at {n}" for n, v in sites.items())
    rows = [
        ("site security", f"TLS + client certificates + ACL, devices enrolled by token (CA {cas})"
         if sec.get("tls") else "INSECURE (plain MQTT)" if sec else "not reached"),
        ("devices", str(len(result.get("devices", []))) + (f" ({per_site})" if sites else "")),
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
    rows += site_rows(result)
    if result.get("agent_restarts"):
        rows.append(("agents restarted (joined late)", ", ".join(result["agent_restarts"])))
    rows.append(("elapsed", f"{result.get('elapsed_s', '?')} s"))
    rows += step_rows(result)
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


def step_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """For a demo that did not run to its end: the steps it did, the one that failed and why, and
    where the logs are (every other row shows what happened up to then)."""
    if not result.get("incomplete") and not result.get("failed_step"):
        return []
    steps = result.get("steps", [])
    done = ", ".join(f"{s.get('n')} {s.get('name')} ({s.get('took_s', '?')} s)" for s in steps
                     if s.get("status") == "done") or "none"
    rows = [("INCOMPLETE: steps done", done)]
    failed = result.get("failed_step")
    if failed:
        rows.append((f"FAILED at step {failed.get('n')} ({failed.get('name')})", str(failed.get("error"))))
    rows.append(("logs", str(result.get("logs", "?"))))
    return rows


def site_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per site (devices, requests served, faults) and the staged rollout of the final release."""
    rows: list[tuple[str, str]] = []
    sites = result.get("sites", {})
    for name, s in sites.items():
        req = s.get("requests", {})
        rel = s.get("release", {})
        faults = ", ".join(f"{f['kind']} {f['target']} at {f['at_s']} s" for f in s.get("faults", [])) or "none"
        live = s.get("devices_live")
        served = (f"resnet {req.get('answered', 0)}/{req.get('sent', 0)} answered ({req.get('failed', 0)} errors, "
                  f"{req.get('mismatched', 0)} wrong, p50 {req.get('p50_ms', '?')} ms)")
        parts = [f"{live if live is not None else '?'}/{len(s.get('devices', []))} devices live", served]
        if rel:
            parts.append(f"{rel.get('checked', 0)} released-CNN predictions, {rel.get('agreement', 0):.0%} = torch")
        if s.get("fog_requests_answered") is not None:
            parts.append(f"fog answered {s['fog_requests_answered']} requests")
        if s.get("trainers"):
            parts.append(f"SuperNodes {', '.join(s['trainers'])}")
        parts.append(f"faults: {faults}")
        rows.append((f"site {name} ({_role(s.get('role', '?'))})", "; ".join(parts)))
    cloud = [f for f in result.get("faults", []) if f.get("site") == "cloud"]
    if sites and cloud:
        rows.append(("faults at the coordinator", ", ".join(f"{f['kind']} at {f['at_s']} s" for f in cloud)))
    ro = result.get("rollout", {})
    for r in ro.get("book", []):
        where = " -> ".join(f"{n} {st.get('state')}" for n, st in r.get("sites", {}).items())
        reason = f" ({r['reason']})" if r.get("reason") else ""
        checks = r.get("checks", [])
        probe = next((c for c in checks if c.startswith("held-out")), None)
        check = (f"; canary check: {probe}" if probe else
                 "; canary check: nothing served it there yet" if any("serves no workload" in c for c in checks)
                 else "")
        rows.append((f"rollout {r['name']} v{r['version']}", f"{r['step']}: {where}{reason}{check}"))
    if ro.get("final"):
        when = "; ".join(f"{n} listed it at {t.get('accepted_s')} s, serves it from {t.get('serving_s')} s"
                         for n, t in ro["final"].items())
        verdict = "canary first" if ro.get("canary_first") else "NOT canary first"
        checked = "checked there first" if ro.get("canary_checked") else "not probed at the canary"
        rows.append((f"rollout timeline v{ro.get('final_version')}", f"{when} ({verdict}; {checked})"))
    return rows


def _role(role: str) -> str:
    """``canary``, or ``#N`` (its place in the rollout order after the canary, as ``fogline sites status``)."""
    return role if role == "canary" or not role.startswith("#") else f"{role} after the canary"


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    # placement map: devices x (replica, partition), before and after the fault
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    canary = (result.get("rollout") or {}).get("canary")
    devices = [d["id"] for d in result.get("devices", []) if canary is None or d.get("site") in (None, canary)]
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
    fig.suptitle("Partition placement (residual CNN, 3 partitions x 2 replicas)"
                 + (f" at {canary}" if canary else ""))
    paths.append(_save(fig, out / "placement.png", plt))

    # latency over time with the fault marked
    tl = result.get("timeline", [])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bad = [(e["t"], 1e3 * e["latency_s"]) for e in tl if e.get("latency_s") is not None and not e["ok"]]
    lanes = sorted({(e.get("site") or "", e.get("replica") or 0) for e in tl if e["ok"]})
    for k, (site, rep) in enumerate(lanes):
        pts = [(e["t"], 1e3 * e["latency_s"]) for e in tl if e.get("latency_s") is not None and e["ok"]
               and (e.get("site") or "") == site and (e.get("replica") or 0) == rep]
        if pts:
            ax.plot(*zip(*pts), "." if k % 2 == 0 else "+", ms=4, color=f"C{k}",
                    label=f"{site + ': ' if site else ''}answered by replica {rep}")
    if bad:
        ax.plot(*zip(*bad), "x", color="r", label="error")
    for f in result.get("faults", []):
        if f["kind"] == "kill -9 device":
            where = f" at {f['site']}" if f.get("site") else ""
            ax.axvline(f["at_s"], color="r", ls="--", label=f"kill -9 {f['target']}{where}")
    ax.set_xlabel("time since demo start (s)")
    ax.set_ylabel("request latency (ms)")
    ax.set_yscale("log")
    _legend_and_title(ax, "Inference latency through the partition chain")
    paths.append(_save(fig, out / "latency.png", plt))

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
    _legend_and_title(ax, "Federated training (PyTorch CNN app, digits)")
    paths.append(_save(fig, out / "accuracy.png", plt))
    if result.get("sites"):
        paths.append(_sites_plot(result, out / "sites.png", plt))
    return paths


def _legend_and_title(ax: Any, title: str) -> None:
    if ax.get_legend_handles_labels()[0]:  # a demo that stopped early may have nothing to label
        ax.legend(fontsize=8)
    ax.set_title(title)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    """Lay out, write and close one figure (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sites_plot(result: dict[str, Any], path: Path, plt: Any) -> Path:
    """Per site: the release rollout (when each site listed and served each version) with the faults,
    and the requests each site served."""
    sites = list(result["sites"])
    ro = result.get("rollout", {})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 1]})
    ys = {n: len(sites) - 1 - i for i, n in enumerate(sites)}
    for e in ro.get("events", []):
        y = ys.get(e["site"])
        if y is None:
            continue
        serving = e["event"] == "serving"
        ax.plot(e["t"], y + (0.15 if serving else -0.15), "s" if serving else "o",
                color=f"C{int(e['version']) % 10}", ms=7, mfc="w" if not serving else None)
        ax.annotate(f"v{e['version']}", (e["t"], y + (0.15 if serving else -0.15)), textcoords="offset points",
                    xytext=(0, 7 if serving else -12), ha="center", fontsize=7)
    for f in result.get("faults", []):
        y = ys.get(f.get("site", ""))
        if y is None:
            ax.axvline(f["at_s"], color="r", ls="--", lw=1, label=f"{f['kind']} ({f.get('site', '?')})")
        else:
            ax.plot(f["at_s"], y, "X", color="r", ms=10, label=f"{f['kind']} {f['target']} ({f['site']})")
    for req in result.get("timeline", [])[:1]:
        ax.axvline(req["t"], color="0.6", lw=0.8, ls=":", label="requests start")
    ax.plot([], [], "o", color="k", mfc="w", label="site lists the version (accepted)")
    ax.plot([], [], "s", color="k", label="site serves it (switched)")
    ax.set_yticks([ys[n] for n in sites])
    ax.set_yticklabels([f"{n}\n({_role(result['sites'][n].get('role', ''))})" for n in sites])
    ax.set_ylim(-0.7, len(sites) - 0.3)
    ax.set_xlabel("time since demo start (s)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax.set_title(f"Staged rollout of {ro.get('name', 'the release')}: canary first, then the others")
    names = list(sites)
    resnet = [result["sites"][n].get("requests", {}).get("answered", 0) for n in names]
    cnn = [int(result["sites"][n].get("release", {}).get("checked", 0)) for n in names]
    bx.bar(names, resnet, color="C0", label="resnet (3 partitions)")
    bx.bar(names, cnn, bottom=resnet, color="C2", label="released CNN")
    for i, n in enumerate(names):
        bx.text(i, resnet[i] + cnn[i], f"{result['sites'][n].get('devices_live', '?')}/"
                f"{len(result['sites'][n].get('devices', []))} live", ha="center", va="bottom", fontsize=8)
    bx.set_ylabel("requests answered")
    bx.set_title("Requests served per site")
    bx.legend(fontsize=7, loc="lower right")
    return _save(fig, path, plt)

"""The site page: one read-only HTML file and the JSON document it polls.

``page_data(status)`` (pure) turns the ``fogline status`` document into what the
page draws: devices grouped by power domain with the partitions placed on them
(coloured by workload, marked by health), replica chains as ordered hops,
workloads and why they are pending, and recent faults. ``page_html()`` is the
page itself (``static/site.html``: inline CSS and JS, no CDN, no build step);
it fetches its endpoint (a ``<meta>`` of the page, ``site.json`` next to it by
default) every ``refresh_s`` and renders with ``textContent`` only: device ids,
labels and reasons are never parsed as HTML.

Serving (``fog_broker.http_api``): the HTML holds no data and may be served
like a static file; the JSON (``page_json(svc.status(...))``) carries the site
and needs the ``status`` right. The page sends ``Authorization: Bearer TOKEN``
when it was opened as ``.../site#token=TOKEN`` (the fragment never reaches the
server; the page keeps it in ``sessionStorage`` and drops it from the address
bar); with a client certificate the browser authenticates by itself. Serve
the page with ``PAGE_HEADERS`` (a CSP that allows exactly its inline script
and style, nothing from elsewhere).
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
import zlib
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from .http_api import HttpApi

__all__ = [
    "NO_DOMAIN",
    "PAGE_HEADERS",
    "POWER_DOMAIN_LABEL",
    "content_security_policy",
    "page_data",
    "page_headers",
    "page_html",
    "page_json",
    "register_http",
    "workload_colour",
]

POWER_DOMAIN_LABEL = "power-domain"
NO_DOMAIN = "no power domain"
MAX_FAULTS = 50
_PART = re.compile(r"^(?P<w>.+)/v(?P<v>\d+)/r(?P<r>\d+)/p(?P<i>\d+):(?P<h>[^:]*)$")
_LOST = {"will": "connection dropped (MQTT will)"}  # the registry's short reasons, as a person reads them
_HEALTH = {"running": "ok", "pending": "starting", "deploying": "starting", "unconfirmed": "starting",
           "lost": "lost"}


# ------------------------------------------------------------------ pure: status -> page document


def workload_colour(name: str) -> str:
    """A stable colour per workload name (the same on every page and every refresh)."""
    hue = zlib.crc32(name.encode()) % 360
    return f"hsl({hue}, 62%, 52%)"


def _finite(x: Any) -> Any:
    """JSON the browser can parse: non-finite floats become null, containers are walked."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _part_id(workload: str, replica: int, index: int) -> str:
    return f"{workload}/r{replica}/p{index}"


def _device(row: Mapping[str, Any]) -> dict[str, Any]:
    labels = {str(k): str(v) for k, v in (row.get("labels") or {}).items()}
    return {
        "id": str(row["id"]), "status": str(row.get("status", "unknown")), "alive": bool(row.get("alive")),
        "labels": labels, "power_domain": labels.get(POWER_DOMAIN_LABEL, NO_DOMAIN),
        "memory_bytes": row.get("memory_bytes"), "free_memory_bytes": row.get("free_memory_bytes"),
        "battery_level": row.get("battery_level"), "charging": row.get("charging"),
        "last_seen_s": row.get("last_seen_s"),
        "lost_reason": _LOST.get(str(row.get("lost_reason")), row.get("lost_reason")),
        "flags": [str(f) for f in row.get("flags") or ()], "partitions": [],
    }


def _placeholder(device_id: str) -> dict[str, Any]:
    """A device the placement names but this page of the status does not list (paged out, or gone)."""
    d = _device({"id": device_id, "status": "unlisted"})
    d["power_domain"] = NO_DOMAIN
    return d


def page_data(status: Mapping[str, Any]) -> dict[str, Any]:
    """The page's document, built from one status document (pure, JSON-ready)."""
    devices: dict[str, dict[str, Any]] = {}
    for row in status.get("devices") or ():
        d = _device(row)
        devices[d["id"]] = d
    workloads: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    placed: dict[tuple[str, str, int, int], dict[str, Any]] = {}  # (device, workload, replica, index)
    versions: dict[str, int] = {}
    for w in status.get("workloads") or ():
        name = str(w["name"])
        colour = workload_colour(name)
        versions[name] = int(w.get("version", 0))
        chains = []
        for rep in w.get("placement") or ():
            r = int(rep["replica"])
            hops: list[tuple[dict[str, Any], str]] = []
            for p in sorted(rep.get("partitions") or (), key=lambda p: int(p["index"])):
                dev = str(p["device"])
                phase = str(p.get("phase", "pending"))
                i = int(p["index"])
                part = {"id": _part_id(name, r, i), "workload": name, "replica": r, "index": i,
                        "segments": list(p.get("segments") or ()), "phase": phase,
                        "health": _HEALTH.get(phase, "starting"), "reported": None, "colour": colour,
                        "reason": p.get("reason")}
                if dev not in devices:
                    devices[dev] = _placeholder(dev)
                devices[dev]["partitions"].append(part)
                placed[(dev, name, r, i)] = part
                hops.append((part, dev))
            chains.append({"replica": r, "hops": [{"part": pt["id"], "device": dev, "index": pt["index"]}
                                                    for pt, dev in hops],
                           "healthy": False, "latency_s": rep.get("latency_s"),
                           # pipeline stages: predicted vs measured s, bytes per frame on links
                           "stages": list(rep.get("stages") or ()),
                           "bottleneck": rep.get("bottleneck")})
        reasons = [{"gate": str(k), "text": str(v)} for k, v in sorted((w.get("reasons") or {}).items())]
        pending.extend({"workload": name, **r} for r in reasons)
        lat = w.get("latency") or {}
        thr = w.get("throughput") or {}
        workloads.append({
            "name": name, "colour": colour, "status": str(w.get("status", "")), "version": versions[name],
            "model": w.get("model"), "tenant": w.get("tenant"), "priority": w.get("priority"),
            "replicas": w.get("replicas"), "healthy_replicas": w.get("healthy_replicas"),
            "reasons": reasons, "chains": chains, "evicted": bool(w.get("evicted")),
            "predicted_s": lat.get("predicted_s"), "measured_p50_s": lat.get("measured_p50_s"),
            "predicted_fps": thr.get("predicted_fps"), "measured_fps": thr.get("measured_fps"),
            # under load (issues 32, 33): replicas wanted, the offered rate, goodput, shed, why it scaled
            "replicas_wanted": (w.get("scaling") or {}).get("replicas_wanted"),
            "offered_rps": (w.get("serving") or {}).get("offered_rps"),
            "goodput_rps": (w.get("serving") or {}).get("goodput_rps"),
            "shed_rps": (w.get("serving") or {}).get("shed_rps"),
            "scale_events": list((w.get("scaling") or {}).get("events") or ()),
            "scale_pending": (w.get("scaling") or {}).get("pending_reason"),
        })
    # What devices report running beyond the placement: the placed ones gain their reported health,
    # the rest (an old version, a partition being undeployed) are shown as orphans.
    colours = {w["name"]: w["colour"] for w in workloads}
    for row in status.get("devices") or ():
        did = str(row["id"])
        d = devices[did]
        for text in (str(x) for x in row.get("partitions") or ()):
            pm = _PART.match(text)
            if pm is None:
                continue
            wl, v, rp, i, health = pm["w"], int(pm["v"]), int(pm["r"]), int(pm["i"]), pm["h"]
            mine = placed.get((did, wl, rp, i))
            if mine is not None and versions.get(wl) == v:
                mine["reported"] = health
                if health == "failed":
                    mine["health"] = "lost"
                continue
            d["partitions"].append({"id": f"{wl}/v{v}/r{rp}/p{i}", "workload": wl, "replica": rp, "index": i,
                                    "segments": [], "phase": "orphan", "health": "orphan", "reported": health,
                                    "colour": colours.get(wl, workload_colour(wl)), "reason": None})
    for w in workloads:  # a chain is healthy when every hop runs and no device reports it failed
        for ch in w["chains"]:
            ch["healthy"] = bool(ch["hops"]) and all(
                placed[(h["device"], w["name"], ch["replica"], h["index"])]["health"] == "ok" for h in ch["hops"])
    domains: dict[str, list[dict[str, Any]]] = {}
    for d in sorted(devices.values(), key=lambda d: d["id"]):
        domains.setdefault(d["power_domain"], []).append(d)
    order = sorted(domains, key=lambda n: (n == NO_DOMAIN, n))
    faults = _faults(status, devices)
    rec = [float(x) for x in status.get("recoveries_s") or ()]
    srt = sorted(rec)
    m = status.get("metrics") or {}
    counts = {s: int(m.get(f"devices_{s}", 0)) for s in ("live", "suspect", "dead")}
    by_status: dict[str, int] = {}
    for w in workloads:
        by_status[w["status"]] = by_status.get(w["status"], 0) + 1
    enr = status.get("enrolment") or {}
    total = int(status.get("devices_total", len(status.get("devices") or ())))
    doc: dict[str, Any] = _finite({
        "site": status.get("site"), "fog_id": status.get("fog_id"), "epoch": status.get("epoch"),
        "ready": bool(status.get("ready")), "secure": bool(status.get("secure")),
        "uptime_s": status.get("uptime_s"),
        "summary": {
            "devices": {**counts, "total": total},
            "enrolment": {"pending": [str(x) for x in enr.get("pending") or ()],
                          "revoked": [str(x) for x in enr.get("revoked") or ()]},
            "workloads": {"total": len(workloads), **by_status},
            "utilization": m.get("utilization"), "fragmentation": m.get("fragmentation"),
        },
        "domains": [{"name": n, "devices": domains[n]} for n in order],
        "workloads": workloads,
        "pending": pending,
        "faults": faults,
        "recoveries": {"count": len(rec), "last_s": rec[-10:], "p50_s": srt[len(srt) // 2] if srt else None,
                       "max_s": srt[-1] if srt else None},
        "devices_shown": len(status.get("devices") or ()), "devices_total": total,
        "truncated": total > len(status.get("devices") or ()),
    })
    return doc


def _faults(status: Mapping[str, Any], devices: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Recent faults, newest first: the fog's event log when the status carries one, else what the
    device rows say now (devices lost or suspect, how long ago they were last heard)."""
    events = status.get("events")
    if isinstance(events, list):
        out = [{**e, "reason": _LOST.get(str(e.get("reason")), e.get("reason"))}
               for e in events if isinstance(e, Mapping)]
        return list(reversed(out))[:MAX_FAULTS]
    out = []
    for d in devices.values():
        if d["status"] in ("dead", "suspect"):
            out.append({"kind": "device lost" if d["status"] == "dead" else "device suspect", "device": d["id"],
                        "reason": d["lost_reason"] or ("missed state adverts" if d["status"] == "suspect" else ""),
                        "ago_s": d["last_seen_s"],
                        "partitions": [p["id"] for p in d["partitions"] if p["phase"] != "orphan"]})
    out.sort(key=lambda f: (f["ago_s"] is None, f["ago_s"] or 0.0, f["device"]))
    return out[:MAX_FAULTS]


def page_json(status: Mapping[str, Any]) -> bytes:
    """``page_data`` as the JSON endpoint's body."""
    return json.dumps(page_data(status), separators=(",", ":"), allow_nan=False).encode()


# ------------------------------------------------------------------ the page


@lru_cache(maxsize=1)
def _template() -> str:
    return resources.files(__package__).joinpath("static/site.html").read_text(encoding="utf-8")


def _set_meta(text: str, name: str, value: str) -> str:
    return re.sub(rf'(<meta name="{name}" content=")[^"]*(">)',
                  lambda m: m.group(1) + html.escape(value, quote=True) + m.group(2), text, count=1)


def page_html(endpoint: str = "site.json", refresh_s: float = 2.0) -> bytes:
    """The page, polling ``endpoint`` (relative to the page) every ``refresh_s`` seconds (at least 0.5)."""
    text = _set_meta(_template(), "fogline-endpoint", endpoint)
    text = _set_meta(text, "fogline-refresh-s", f"{max(0.5, float(refresh_s)):g}")
    return text.encode("utf-8")


def _inline_hashes(tag: str) -> list[str]:
    text = _template()
    out = []
    for m in re.finditer(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL):
        digest = hashlib.sha256(m.group(1).encode("utf-8")).digest()
        out.append(f"'sha256-{base64.b64encode(digest).decode()}'")
    return out


@lru_cache(maxsize=1)
def content_security_policy() -> str:
    """Only the page's own inline script and style run; it may fetch from its own origin only."""
    return ("default-src 'none'; "
            f"script-src {' '.join(_inline_hashes('script'))}; "
            f"style-src {' '.join(_inline_hashes('style'))}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


PAGE_HEADERS: dict[str, str] = {
    "Content-Type": "text/html; charset=utf-8",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def page_headers() -> dict[str, str]:
    """``PAGE_HEADERS`` plus the Content-Security-Policy of the page."""
    return {**PAGE_HEADERS, "Content-Security-Policy": content_security_policy()}


def register_http(app: web.Application, api: HttpApi, *, path: str = "/site", right: str = "status") -> None:
    """``GET /site`` (the page) and ``GET /site.json`` (its data) on the fog's HTTP server
    (``HttpApi.extend(site_page.register_http)``).

    The page is static and holds no data: it is served to anyone who reaches the port, with
    ``page_headers()``. The JSON is the site: callers authenticate as on the rest of the API
    and need ``right`` (``status``: operators and coordinators); the status is built from the
    site core's snapshot off the server's loop (``api.off_loop``).
    """
    import asyncio

    from aiohttp import web

    endpoint = path.rstrip("/").rsplit("/", 1)[-1] + ".json"  # relative to the page: works behind a prefix
    body = page_html(endpoint)
    headers = page_headers()

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=body, headers=headers)

    async def data(request: web.Request) -> web.Response:
        api.principal(request, right)
        status = await api.off_loop(api.svc.status)
        doc = await asyncio.get_running_loop().run_in_executor(None, page_json, status)
        return web.Response(body=doc, headers={"Content-Type": "application/json", "Cache-Control": "no-store",
                                               "X-Content-Type-Options": "nosniff"})

    app.router.add_get(path, page)
    app.router.add_get(path.rstrip("/") + ".json", data)

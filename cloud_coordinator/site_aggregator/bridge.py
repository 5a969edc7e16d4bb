"""The cloud's view of a site: a ClientApp on the fog's SuperNode that answers with the site's aggregate.

``fogline coordinator --hierarchical`` submits the user's Flower App with
this ClientApp in place of the user's, so the cloud's SuperNodes are sites,
one per fog, authenticated by Flower's SuperNode keys like devices are. A
``train`` Message becomes a job for the site server (``spool``); the reply
carries the site aggregate in the Message's own array layout, the site's
example count (``num-examples``, the accepted devices') and the site's
counts (``site-clients``, ``site-accepted``, ``site-rejected``,
``site-rejected-<reason>``), which the cloud keeps in the round's metrics.
The WAN carries one update per site per round instead of one per device.

Node config (``flower-supernode --node-config``): ``site-spool`` (the site
server's spool directory, required) and ``site`` (its name, for logs).
"""
from __future__ import annotations

import logging
import re
import time
from collections import Counter

from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..layout import reason_key
from .spool import Job, Spool, SpoolFull, from_config

__all__ = ["REPLY_MARGIN_S", "app", "site_reply", "train", "evaluate"]

log = logging.getLogger("fogline.site-rounds")
REPLY_MARGIN_S = 5.0       # the site answers this long before the cloud stops waiting for the Message
SITE_FAILED = 3001         # Flower error codes of ours (a ClientApp's own error range)
NO_SPOOL = 3002

# No fault hook here (tests of a Byzantine site ship simulations.faulty_bridge: --site-bridge)
app = ClientApp()


def _slug(reason: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")[:48]


def site_reply(msg: Message, spool: Spool) -> Message:
    """Hand the Message's round to the site server and turn its outcome into the reply."""
    records = msg.content.array_records
    if len(records) != 1:
        return Message(Error(SITE_FAILED, f"a train Message needs one ArrayRecord, got {len(records)}"), reply_to=msg)
    key, rec = next(iter(records.items()))
    names = tuple(rec.keys())
    cfg_records = msg.content.config_records
    config = from_config(next(iter(cfg_records.values()))) if cfg_records else {}
    now = time.time()
    created = float(msg.metadata.created_at or 0.0)
    created = created if abs(now - created) < 30.0 else now  # a skewed cloud clock: count from arrival
    wait = float(config.get("round-timeout", 0.0) or 0.0) or float(msg.metadata.ttl or 0.0) or 600.0
    deadline = created + wait - REPLY_MARGIN_S  # the cloud's round-timeout: answer while it still listens
    job = Job(Spool.job_id(int(msg.metadata.run_id), int(config.get("server-round", 0)), msg.metadata.message_id),
              int(config.get("server-round", 0)), names, tuple(rec[n].numpy() for n in names), config,
              max(deadline, now + 1.0))
    try:
        spool.submit(job)
    except SpoolFull as exc:
        return Message(Error(SITE_FAILED, str(exc)), reply_to=msg)
    out = spool.wait(job)
    if out is None:
        return Message(Error(SITE_FAILED, "the site's round did not finish before the cloud's deadline"), reply_to=msg)
    if out.arrays is None or out.names != names:
        return Message(Error(SITE_FAILED, f"the site's round failed: {out.failure or 'no aggregate'}"), reply_to=msg)
    metrics: dict[str, int | float | list[int] | list[float]] = {
        "num-examples": out.examples, "site-clients": float(len(out.clients)),
        "site-accepted": float(len(out.accepted)), "site-rejected": float(len(out.rejected)),
        "site-seconds": out.seconds}
    for why, n in Counter(reason_key(w) for w in out.rejected.values()).items():
        metrics[f"site-rejected-{_slug(why)}"] = float(n)
    content = RecordDict({key: ArrayRecord({n: Array(a) for n, a in zip(names, out.arrays)}),
                          "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    spool_dir = str(context.node_config.get("site-spool", "") or "")
    if not spool_dir:
        return Message(Error(NO_SPOOL, "this SuperNode has no site-spool in its node config: start it with "
                                       "fogline site-aggregator"), reply_to=msg)
    return site_reply(msg, Spool(spool_dir))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Sites do not evaluate for the cloud (its ServerApp evaluates centrally): a clear error, not a hang."""
    return Message(Error(SITE_FAILED, "a site bridge does not evaluate; use the ServerApp's central evaluation"),
                   reply_to=msg)

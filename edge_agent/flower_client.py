"""Flower ClientApp helpers for devices: who this node is, and simulated Byzantine faults.

Devices run a Flower SuperNode next to the agent; the ClientApp itself comes
with the Flower App (``examples/digits``, ``examples/pytorch`` or the user's
own). ``simulated_faults`` is a Flower mod (``ClientApp(mods=[simulated_faults])``)
that does nothing unless the SuperNode's node config names an attack, e.g.
``flower-supernode ... --node-config "byzantine='sign-flip'"``; simulations and
tests use it to put a Byzantine client among honest ones without changing
the app. The update attacks themselves live in ``runtime.attacks``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

__all__ = ["ATTACKS", "apply_attack", "simulated_faults", "device_identity"]

log = logging.getLogger("fogline.edge.flower")
# update attacks (runtime.attacks), then malformed replies a robust server must survive
ATTACKS = ("sign-flip", "gaussian", "nan", "inf-examples", "wrong-shape")


def device_identity(context: Context) -> tuple[str, int]:
    """(device id, partition id) as the node config says: for logs only, never trusted by the server."""
    nc = context.node_config
    return str(nc.get("device-id", "")) or f"node-{context.node_id}", int(nc.get("partition-id", 0))


def apply_attack(mode: str, global_w: list[np.ndarray], honest_w: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Turn this client's honest arrays into a Byzantine update (it sees only its own update)."""
    from runtime import attacks

    flat = np.concatenate([(np.asarray(h, np.float64) - g).ravel() for g, h in zip(global_w, honest_w, strict=True)])
    if mode == "sign-flip":
        bad = attacks.sign_flip(flat[None, :], 1)[0]
    elif mode == "gaussian":
        bad = attacks.gaussian(flat[None, :], 1, rng=np.random.default_rng(seed))[0]
    elif mode == "nan":
        bad = np.full_like(flat, np.nan)
    else:
        raise ValueError(f"unknown update attack {mode!r}; known: {', '.join(ATTACKS)}")
    out, i = [], 0
    for g in global_w:
        out.append((g + bad[i:i + g.size].reshape(g.shape)).astype(g.dtype))
        i += g.size
    return out


def simulated_faults(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: with node config ``byzantine=MODE``, falsify this node's training replies."""
    reply = call_next(msg, context)
    mode = str(context.node_config.get("byzantine", ""))
    if not mode or msg.metadata.message_type != "train" or reply.has_error():
        return reply
    if mode not in ATTACKS:
        log.warning("unknown byzantine mode %r; replying honestly", mode)
        return reply
    sent = msg.content.array_records
    got = reply.content.array_records
    if len(sent) != 1 or len(got) != 1:
        return reply
    key = next(iter(got))
    names = list(got[key].keys())
    global_w = [a.numpy() for a in next(iter(sent.values())).values()]
    honest = [got[key][n].numpy() for n in names]
    metrics = {k: v for rec in reply.content.metric_records.values() for k, v in rec.items()}
    if mode == "inf-examples":
        metrics["num-examples"] = float("inf")
        arrays = honest
    elif mode == "wrong-shape":
        arrays = [np.zeros((a.size + 1,), a.dtype) for a in honest]
    else:
        server_round = msg.content.config_records["config"].get("server-round", 0)
        if isinstance(server_round, list):
            raise TypeError(f"server-round is not a number: {server_round!r}")
        arrays = apply_attack(mode, global_w, honest, int(server_round))
    content = RecordDict({key: ArrayRecord({n: Array(np.asarray(a).copy(order="C")) for n, a in zip(names, arrays)}),
                          "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)

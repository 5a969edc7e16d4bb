"""Flower ClientApp: local training of the global model on this device's data partition.

The SuperNode's node config says who this device is and which data it holds
(``device-id``, ``partition-id``, ``num-partitions``), plus an optional
``byzantine`` attack mode for simulations (sign-flip, gaussian, label-flip;
the attacks themselves live in ``cloud_coordinator.attacks``). The round
config carries the seed, so a repeated round trains exactly the same way.
"""
from __future__ import annotations

import logging
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from cloud_coordinator.rounds import RunConfig, client_seed

__all__ = ["app", "device_identity", "apply_attack", "ATTACKS"]

log = logging.getLogger("fogline.edge.flower")
ATTACKS = ("sign-flip", "gaussian", "label-flip")

app = ClientApp()


def device_identity(context: Context) -> tuple[str, int]:
    """(device id, partition id) from the node config; the node id stands in for a missing device id."""
    nc = context.node_config
    device = str(nc.get("device-id", "")) or f"node-{context.node_id}"
    return device, int(nc.get("partition-id", 0))


def apply_attack(mode: str, global_w: tuple[np.ndarray, ...], honest_w: tuple[np.ndarray, ...],
                 seed: int) -> tuple[np.ndarray, ...]:
    """Turn this client's honest result into a Byzantine one.

    A real device sees only its own update, so the attack is given that one
    row as "the honest updates" (the simulator's omniscient variant lives in
    ``cloud_coordinator.attacks`` callers).
    """
    from cloud_coordinator import attacks

    flat = np.concatenate([(h - g).ravel() for g, h in zip(global_w, honest_w, strict=True)])[None, :]
    if mode == "sign-flip":
        bad = attacks.sign_flip(flat, 1)[0]
    elif mode == "gaussian":
        bad = attacks.gaussian(flat, 1, rng=np.random.default_rng(seed))[0]
    else:
        raise ValueError(f"unknown update attack {mode!r}; known: {', '.join(ATTACKS)}")
    out, i = [], 0
    for g in global_w:
        out.append((g + bad[i:i + g.size].reshape(g.shape)).astype(g.dtype))
        i += g.size
    return tuple(out)


def _flip_labels(y: np.ndarray) -> np.ndarray:
    from cloud_coordinator import attacks

    return attacks.flip_labels(y, 10)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train from the sent weights; reply weights, example count and who we are."""
    from cloud_coordinator.training import client_data, local_train

    conf = dict(msg.content["config"])
    cfg = RunConfig.from_mapping(conf)
    device, partition = device_identity(context)
    nparts = int(context.node_config.get("num-partitions", cfg.num_partitions))
    if nparts != cfg.num_partitions:
        cfg = RunConfig.from_mapping({**conf, "num-partitions": nparts})
    rnd = int(conf["server-round"])
    seed = int(conf.get("client-seed", client_seed(cfg.seed, rnd, device)))
    module = str(conf.get("model-module", "models.train"))
    x, y = client_data(cfg, partition, module)
    attack = str(context.node_config.get("byzantine", ""))
    if attack == "label-flip":
        y = _flip_labels(y)
    global_w = tuple(np.asarray(a) for a in msg.content["arrays"].to_numpy_ndarrays())
    new_w, metrics = local_train(cfg, global_w, x, y, seed, module)
    if attack in ("sign-flip", "gaussian"):
        new_w = apply_attack(attack, global_w, new_w, seed)
    content = RecordDict({
        "arrays": ArrayRecord([np.asarray(w) for w in new_w]),
        "metrics": MetricRecord({"num-examples": int(len(y)), **metrics}),
        "info": ConfigRecord({"device-id": device, "partition-id": partition, "attack": attack}),
    })
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Who is this node (used to map Flower node ids to device ids)."""
    device, partition = device_identity(context)
    return Message(RecordDict({"info": ConfigRecord({"device-id": device, "partition-id": partition})}),
                   reply_to=msg)

"""digits_app: the ClientApp (local epochs of SGD on this node's partition)."""
from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from digits_app.task import build, client_seed, data_of
from edge_agent.flower_client import simulated_faults

# simulated_faults does nothing unless a SuperNode's node config says byzantine=... (tests, demos)
app = ClientApp(mods=[simulated_faults])


def _partition(context: Context) -> tuple[int, int]:
    nc = context.node_config
    return int(nc.get("partition-id", 0)), int(nc.get("num-partitions", context.run_config["num-partitions"]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    rc = context.run_config
    pid, nparts = _partition(context)
    x, y = data_of(rc, pid, nparts)
    cfg = msg.content["config"]
    model = build(rc, seed=client_seed(int(rc["seed"]), int(cfg["server-round"]), pid))
    model.set_weights(msg.content["arrays"].to_numpy_ndarrays())
    out = model.fit(x, y, epochs=int(cfg.get("local-epochs", rc["local-epochs"])), lr=float(cfg.get("lr", rc["lr"])))
    content = RecordDict({"arrays": ArrayRecord(model.get_weights()),
                          "metrics": MetricRecord({"num-examples": len(y), "train_loss": out["loss"],
                                                   "train_accuracy": out["accuracy"]})})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    rc = context.run_config
    pid, nparts = _partition(context)
    x, y = data_of(rc, pid, nparts)
    model = build(rc)
    model.set_weights(msg.content["arrays"].to_numpy_ndarrays())
    loss, acc = model.evaluate(x, y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": len(y), "loss": loss, "accuracy": acc})}),
                   reply_to=msg)

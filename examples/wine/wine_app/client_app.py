"""wine_app: the ClientApp. It trains only: there is no federated evaluation in this app."""
from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from wine_app.task import fit, partition, score

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    rc, nc = context.run_config, context.node_config
    x, y = partition(int(rc["seed"]), int(nc.get("partition-id", 0)),
                     int(nc.get("num-partitions", rc["num-partitions"])))
    w = fit(msg.content.array_records["arrays"].to_numpy_ndarrays(), x, y, int(rc["local-epochs"]), float(rc["lr"]))
    loss, acc = score(w, x, y)
    metrics = MetricRecord({"num-examples": len(y), "train_loss": loss, "train_accuracy": acc})
    return Message(RecordDict({"arrays": ArrayRecord(w), "metrics": metrics}), reply_to=msg)

"""digits_app: the ServerApp (robust rounds with central evaluation on the held-out digits)."""
from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from cloud_coordinator import RobustStrategy
from digits_app.task import build, test_set

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    strategy = RobustStrategy(rule=str(rc["rule"]), f=int(rc["f"]), fraction_evaluate=float(rc["fraction-evaluate"]),
                              min_train_nodes=int(rc["min-train-nodes"]), round_timeout=float(rc["round-timeout"]),
                              grace=float(rc["grace"]), seed=int(rc["seed"]))

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        x, y = test_set(rc)
        model = build(rc)
        model.set_weights(arrays.to_numpy_ndarrays())
        loss, acc = model.evaluate(x, y)
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy.start(grid=grid, initial_arrays=ArrayRecord(build(rc).get_weights()),
                   num_rounds=int(rc["num-server-rounds"]),
                   # everything that changes the trained model rides in the train config: a checkpoint
                   # of another configuration is never resumed from
                   train_config=ConfigRecord({"lr": float(rc["lr"]), "local-epochs": int(rc["local-epochs"]),
                                              "data": f"{rc['seed']}/{rc['iid']}/{rc['alpha']}/{rc['num-partitions']}"}),
                   evaluate_fn=central_evaluate)

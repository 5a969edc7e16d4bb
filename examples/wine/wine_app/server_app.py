"""wine_app: the ServerApp. As ``flwr new`` writes it, with ``RobustStrategy`` in place of ``FedAvg``."""
from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from cloud_coordinator import RobustStrategy
from wine_app.task import held_out, initial, score

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    strategy = RobustStrategy(rule=str(rc["rule"]), f=int(rc["f"]), min_train_nodes=int(rc["min-train-nodes"]))

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, acc = score(arrays.to_numpy_ndarrays(), *held_out(int(rc["seed"])))
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial()), num_rounds=int(rc["num-server-rounds"]),
                   evaluate_fn=central)

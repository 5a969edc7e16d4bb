"""pytorchexample: A Flower / PyTorch app."""
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from cloud_coordinator import RobustStrategy
from pytorchexample.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]

    torch.manual_seed(0)
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # The one line that differs from Flower's quickstart (there: FedAvg(fraction_evaluate=...))
    strategy = RobustStrategy(fraction_evaluate=fraction_evaluate)

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate model on central data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    test_loss, test_acc = test(model, load_centralized_dataset(), torch.device("cpu"))
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})

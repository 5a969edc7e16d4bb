"""The same RobustStrategy in Flower's Simulation Engine (Ray backend): 50 virtual clients, 5 Byzantine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from cloud_coordinator import CheckpointConfig, RobustStrategy, RoundConfig
from edge_agent.flower_client import simulated_faults
from models.digits import load_digits_split
from models.train import SoftmaxRegression

pytestmark = pytest.mark.slow
N, BYZANTINE, ROUNDS = 50, 5, 3
# A round waits for all 50 replies (a few seconds here on a quiet machine): a grace as long as
# the round timeout, which only catches a hang. A 1 s grace after the quorum of 40 was a race
# on a busy machine: the last replies came later, 3 of the first 40 were the liars, and Bulyan
# (f=5, 40 usable replies) skipped the round.
ROUND_TIMEOUT_S = 600


def _split():  # type: ignore[no-untyped-def]
    return load_digits_split(N, seed=0)


def _client_app() -> ClientApp:
    app = ClientApp(mods=[simulated_faults])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        x, y = _split().clients[pid]
        model = SoftmaxRegression(seed=pid)
        model.set_weights(msg.content["arrays"].to_numpy_ndarrays())
        out = model.fit(x, y, epochs=2, lr=0.2)
        if pid < BYZANTINE:  # the first five nodes lie about everything they can
            context.node_config["byzantine"] = "sign-flip" if pid % 2 else "inf-examples"
        return Message(RecordDict({"arrays": ArrayRecord(model.get_weights()),
                                   "metrics": MetricRecord({"num-examples": len(y), "train_loss": out["loss"]})}),
                       reply_to=msg)

    return app


def _server_app(ckpt: Path) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        x, y = _split().test

        def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            m = SoftmaxRegression()
            m.set_weights(arrays.to_numpy_ndarrays())
            loss, acc = m.evaluate(x, y)
            return MetricRecord({"loss": loss, "accuracy": acc})

        strategy = RobustStrategy("bulyan", f=BYZANTINE,
                                  rounds=RoundConfig(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=40,
                                                     round_timeout=ROUND_TIMEOUT_S, grace=ROUND_TIMEOUT_S),
                                  checkpoints=CheckpointConfig(dirs=[ckpt]))
        strategy.start(grid=grid, initial_arrays=ArrayRecord(SoftmaxRegression().get_weights()),
                       num_rounds=ROUNDS, train_config=ConfigRecord({"lr": 0.2}), evaluate_fn=evaluate)

    return app


def _simulate(ckpt: Path) -> None:
    run_simulation(server_app=_server_app(ckpt), client_app=_client_app(), num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False,
                                                 "object_store_memory": 100 * 1024 * 1024}})


# Ray runs its driver's threads inside the process that starts the simulation: in a child of
# its own, a Ray that fails or is slow to shut down (a busy machine) cannot take the test
# runner with it (it once did: a segfault in pytest minutes after this test).
CHILD = "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); " \
        "import test_simulation as t; t._simulate(Path(sys.argv[2]))"


@pytest.mark.timeout(900)
def test_robust_strategy_in_the_simulation_engine_with_50_clients(tmp_path: Path) -> None:
    here = Path(__file__).resolve()
    done = subprocess.run([sys.executable, "-c", CHILD, str(here.parent), str(tmp_path)],
                          cwd=here.parents[2], capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["rounds_done"] == ROUNDS
    for h in rep["history"]:
        assert len(h["clients"]) == N and not h.get("skipped")
        bad = {d for d, why in h["rejected"].items() if why in ("absurd example count",)}
        assert len(bad) == 3  # the inf-examples liars never reach the rule
    assert rep["history"][-1]["server"]["accuracy"] > 0.8
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.json"))[-1] == f"ckpt-{ROUNDS:08d}.json"

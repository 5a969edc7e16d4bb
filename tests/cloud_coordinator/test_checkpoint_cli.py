"""`fogline coordinator` argument handling (no Flower processes are started here)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cloud_coordinator.launcher import write_app
from runtime.cli import build_parser, main


@pytest.mark.parametrize("argv, msg", [
    (["--rule", "nope"], "unknown rule"),
    (["--rounds", "0"], "--rounds"),
    (["--superlink", "nohostport"], "HOST:PORT"),
])
def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                              msg: str) -> None:
    assert main(["coordinator", "--checkpoint-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and msg in err


def test_run_config_and_app_scaffold(tmp_path: Path) -> None:
    import tomllib

    from cloud_coordinator.cli import run_config_from_args
    from cloud_coordinator.rounds import RunConfig

    args = build_parser().parse_args(["coordinator", "--checkpoint-dir", str(tmp_path / "a"), "--replica-dir",
                                      str(tmp_path / "b"), "--rounds", "4", "--rule", "bulyan", "--f", "2",
                                      "--non-iid", "0.3", "--seed", "9"])
    rc = run_config_from_args(args)
    cfg = RunConfig.from_mapping(rc)
    assert (cfg.rounds, cfg.rule, cfg.f, cfg.iid, cfg.alpha, cfg.seed) == (4, "bulyan", 2, False, 0.3, 9)
    assert rc["checkpoint-dirs"].count(str(tmp_path)) == 2
    doc = tomllib.loads(write_app(tmp_path / "app", rc).read_text())
    assert doc["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "cloud_coordinator.flower_server:app", "clientapp": "edge_agent.flower_client:app"}
    assert RunConfig.from_mapping(doc["tool"]["flwr"]["app"]["config"]) == cfg

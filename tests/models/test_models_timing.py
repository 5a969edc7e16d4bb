"""Measured segment times (``models.timing.time_segments``, ``fogline models bench-segments``).

Only structure and consistency are asserted here; how close the times predict a
chain's latency is a benchmark figure (``fogline bench models``), not a test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from models import zoo
from models.cuts import chain_profile
from models.errors import ModelError
from models.graph import analyze
from models.timing import SegmentTimes, time_segments


def _cli(argv: list[str]) -> int:
    from runtime.cli import main  # the whole command: bad arguments are one "error:" line, exit 2

    return main(argv)


@pytest.mark.parametrize("how", ["default", "positions", "profile"])
def test_one_time_per_segment(how: str) -> None:
    ga = analyze(zoo.build("resnet"))
    cp = chain_profile(ga, 4, strategy="balanced")
    cuts = {"default": None, "positions": [c.index for c in cp.cuts], "profile": cp}[how]
    t = time_segments(ga, cuts, repeats=3, warmup=1)
    n = 16 if how == "default" else 4
    assert isinstance(t, SegmentTimes) and len(t.seconds) == len(t.segments) == n
    assert t.segments[0][0] == 0 and t.segments[-1][1] == len(ga.nodes)
    assert all(a[1] == b[0] for a, b in zip(t.segments, t.segments[1:]))
    assert all(s > 0 for s in t.seconds) and t.whole_s > 0 and t.chain_s > 0
    assert sum(t.calibrated) == pytest.approx(t.whole_s, rel=1e-9)
    assert t.providers == ("CPUExecutionProvider",) and t.threads == 1
    if how != "default":
        assert t.flops == tuple(seg.flops for seg in cp.segments)
    json.dumps(t.to_dict())


def test_clock_is_a_parameter() -> None:
    ticks = iter(range(10_000))
    t = time_segments(zoo.build("mlp"), [1], repeats=4, warmup=0,
                      clock=lambda: float(next(ticks)))
    assert t.seconds == (1.0, 1.0) and t.whole_s == 1.0 and t.chain_s == 1.0


@pytest.mark.parametrize(("kw", "match"), [
    ({"providers": ["NoSuchExecutionProvider"]}, "NoSuchExecutionProvider is not available"),
    ({"repeats": 0}, "repeats and threads must be >= 1"),
])
def test_bad_arguments(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ModelError, match=match) as info:
        time_segments(zoo.build("mlp"), [1], **kw)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_cli_json_and_device_class(tmp_path: Path, capsys) -> None:
    path = tmp_path / "resnet.onnx"
    path.write_bytes(zoo.build("resnet").SerializeToString())
    assert _cli(["models", "bench-segments", str(path), "--segments", "3", "--repeats", "2",
                 "--device-class", "laptop", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["seconds"]) == 3 and list(d["segment_times_s"]) == ["laptop"]
    assert d["segment_times_s"]["laptop"] == d["calibrated_s"]
    assert _cli(["models", "bench-segments", str(path), "--cuts", "3", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "whole model" in out and len(out.strip().splitlines()) == 4


@pytest.mark.parametrize(("extra", "needle"), [
    (["--providers", "NoSuchExecutionProvider"], "is not available here"),
    (["--cuts", "x"], "--cuts expects"),
    (["--repeats", "0"], "--repeats: 0 is out of range"),
])
def test_cli_errors_exit_2(tmp_path: Path, capsys, extra: list[str], needle: str) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(zoo.build("mlp").SerializeToString())
    assert _cli(["models", "bench-segments", str(path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err

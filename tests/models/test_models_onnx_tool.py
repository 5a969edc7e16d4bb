"""Dev cross-check: our MACs agree with onnx-tool's per node (skipped if it is not installed).

onnx-tool counts a bias add as one more MAC per output element; we count it as a
FLOP (``flops - 2 * macs``), so that is added back before comparing.
"""
from __future__ import annotations

import pytest

from models import zoo
from models.profile import profile_model

onnx_tool = pytest.importorskip("onnx_tool")


@pytest.mark.parametrize("name", [n for n in zoo.NAMES if n != "deep"])
def test_macs_match_onnx_tool(name: str) -> None:
    model = zoo.build(name)
    ours = profile_model(model)
    theirs = onnx_tool.Model(model, {"verbose": False})
    theirs.graph.shape_infer()
    theirs.graph.profile()
    checked = 0
    for node in ours.nodes:
        if node.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        macs = theirs.graph.nodemap[node.name].macs
        macs = macs[0] if isinstance(macs, (list, tuple)) else macs
        assert macs == node.macs + (node.flops - 2 * node.macs), node.name
        checked += 1
    assert checked > 0

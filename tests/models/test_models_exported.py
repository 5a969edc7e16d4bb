"""Models exported here by other frameworks' own exporters, then profiled, split and chained.

- PyTorch (CPU wheel, random weights): a residual CNN and a two-input, two-output
  transformer encoder (token ids + a boolean padding mask), through the TorchScript
  exporter and through the torch.export-based one (``dynamo=True``, which keeps its
  weights in an external ``.data`` file);
- scikit-learn through skl2onnx: a scaler + PCA + logistic-regression pipeline with
  the ``ai.onnx.ml`` domain, with and without ZipMap (a sequence of maps as output),
  and a random forest (one tree-ensemble node: a one-line refusal to cut);
- onnxruntime's own tools on the CNN: static int8 quantization in QDQ and in
  QOperator format (``QLinearConv`` plus ``com.microsoft`` ``QLinearAdd``/``QGemm``),
  and fp16 conversion.

Each model: profile, split 2, 3 and 4 ways (or refuse in one line), chain the
partitions in onnxruntime and compare with the monolithic run (relative difference
<= 1e-5; int8 and fp16 chains run the very same kernels, so they must match too).
"""
from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from models.cuts import chain_profile
from models.errors import ModelError, ProfileWarning
from models.partition import Partitioner
from models.probe import analyze, feeds_for, rel_diff, session_options
from models.profile import profile_model

from chain_helpers import split_and_compare

ort = pytest.importorskip("onnxruntime")
TOL = 1e-5


# ------------------------------------------------------------------ exporters


def _torch_models(out: Path) -> dict[str, tuple[Path, dict[str, list[int]]]]:
    torch = pytest.importorskip("torch", reason="torch exports (pip install torch, CPU wheel)")
    nn = torch.nn
    torch.manual_seed(0)

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.c2 = nn.Conv2d(16, 16, 3, padding=1)
            self.c3 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = torch.relu(self.b1(self.c1(x)))
            h = h + torch.relu(self.c2(h))  # a residual: cuts inside carry two tensors
            h = torch.relu(self.c3(h))
            return self.fc(h.mean((2, 3)))

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(32, 5)

        def forward(self, ids, mask):  # type: ignore[no-untyped-def]
            h = self.enc(self.emb(ids), src_key_padding_mask=mask)
            return self.head(h[:, 0]), h

    found: dict[str, tuple[Path, dict[str, list[int]]]] = {}
    x = torch.randn(1, 3, 32, 32)
    ids, mask = torch.randint(0, 100, (2, 12)), torch.zeros(2, 12, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cnn = out / "torch_cnn.onnx"
        torch.onnx.export(CNN().eval(), (x,), str(cnn), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N", 2: "H", 3: "W"}})
        found["torch-cnn"] = (cnn, {"x": [1, 3, 32, 32]})
        enc = out / "torch_encoder.onnx"
        torch.onnx.export(Encoder().eval(), (ids, mask), str(enc), dynamo=False,
                          input_names=["ids", "mask"], output_names=["logits", "hidden"],
                          dynamic_axes={"ids": {0: "B", 1: "T"}, "mask": {0: "B", 1: "T"}})
        found["torch-encoder"] = (enc, {"ids": [2, 12], "mask": [2, 12]})
        try:
            import onnxscript  # noqa: F401
        except ImportError:
            return found
        dyn = out / "torch_cnn_dynamo.onnx"
        prog = torch.onnx.export(CNN().eval(), (x,), dynamo=True, verbose=False)
        prog.save(str(dyn), external_data=True)  # weights in torch_cnn_dynamo.onnx.data
        found["torch-cnn-dynamo"] = (dyn, {})
    return found


def _sklearn_models(out: Path) -> dict[str, tuple[Path, dict[str, list[int]]]]:
    skl2onnx = pytest.importorskip("skl2onnx", reason="scikit-learn exports (pip install skl2onnx)")
    from sklearn.datasets import load_digits
    from sklearn.decomposition import PCA
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32)
    pipe = make_pipeline(StandardScaler(), PCA(16), LogisticRegression(max_iter=300)).fit(X, y)
    forest = RandomForestClassifier(8, max_depth=4, random_state=0).fit(X, y)
    found = {}
    for name, model, opts in (("skl-pipeline", pipe, {id(pipe): {"zipmap": False}}),
                              ("skl-pipeline-zipmap", pipe, None),
                              ("skl-forest", forest, {id(forest): {"zipmap": False}})):
        path = out / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path.write_bytes(skl2onnx.to_onnx(model, X[:1], options=opts).SerializeToString())
        found[name] = (path, {"X": [3, 64]})
    return found


def _ort_tool_models(out: Path, cnn: Path) -> dict[str, tuple[Path, dict[str, list[int]]]]:
    """int8 (QDQ, QOperator) and fp16 versions of the torch CNN, by onnxruntime's own tools."""
    import onnx

    from models.graph import set_input_shapes

    quant = pytest.importorskip("onnxruntime.quantization")
    f16 = pytest.importorskip("onnxruntime.transformers.float16")
    fixed = out / "cnn_fixed.onnx"
    onnx.save(set_input_shapes(onnx.load(str(cnn)), {"x": [1, 3, 32, 32]}), str(fixed))

    class Reader(quant.CalibrationDataReader):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.left = 4

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.left == 0:
                return None
            self.left -= 1
            rng = np.random.default_rng(self.left)
            return {"x": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)}

    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fmt in (("cnn-int8-qdq", quant.QuantFormat.QDQ),
                          ("cnn-int8-qop", quant.QuantFormat.QOperator)):
            path = out / f"{name}.onnx"
            quant.quantize_static(str(fixed), str(path), Reader(), quant_format=fmt)
            found[name] = (path, {})
        half = out / "cnn-fp16.onnx"
        onnx.save(f16.convert_float_to_float16(onnx.load(str(fixed)), keep_io_types=False),
                  str(half))
        found["cnn-fp16"] = (half, {})
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str], tuple[Path, dict[str, list[int]]]]:
    out = tmp_path_factory.mktemp("exported")
    cache: dict[str, tuple[Path, dict[str, list[int]]]] = {}

    def get(name: str) -> tuple[Path, dict[str, list[int]]]:
        if name not in cache:
            if name.startswith("torch"):
                cache.update(_torch_models(out))
            elif name.startswith("skl"):
                cache.update(_sklearn_models(out))
            else:
                cache.update(_ort_tool_models(out, get("torch-cnn")[0]))
        if name not in cache:
            pytest.skip(f"{name}: its exporter is not installed (torch.onnx dynamo needs "
                        f"onnxscript)")
        return cache[name]
    return get


NAMES = ["torch-cnn", "torch-encoder", "torch-cnn-dynamo", "skl-pipeline",
         "skl-pipeline-zipmap", "skl-forest", "cnn-int8-qdq", "cnn-int8-qop", "cnn-fp16"]


def _run_file(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, object]:
    """The monolithic model, loaded from its path (external data resolves next to it)."""
    sess = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})))


@pytest.mark.parametrize("name", NAMES)
def test_exported_model_splits_and_chains(name: str, exported) -> None:
    path, shapes = exported(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)  # ai.onnx.ml / com.microsoft ops
        ga = analyze(path, input_shapes=shapes)
        prof = profile_model(ga)
        p = Partitioner(ga)
    assert prof.peak_activation_bytes > 0
    chain_profile(ga, 16, strategy="balanced").to_dict()
    feeds = feeds_for(ga, seed=11)
    ref = _run_file(path, feeds)
    assert set(ref) == set(ga.outputs)
    done = split_and_compare(p, feeds, ref, TOL)
    assert bool(done) == (name != "skl-forest")  # one tree-ensemble node: nothing to cut


def test_what_the_exporters_produced(exported) -> None:
    """Guard the coverage claims: external data, ai.onnx.ml, com.microsoft, QDQ, fp16, maps."""
    import onnx

    def ops(name: str) -> set[str]:
        m = onnx.load(str(exported(name)[0]), load_external_data=False)
        return {f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in m.graph.node}

    dyn = exported("torch-cnn-dynamo")[0]
    assert Path(f"{dyn}.data").is_file()
    assert analyze(dyn).external_dir == str(dyn.parent.resolve())
    assert "ai.onnx.ml::LinearClassifier" in ops("skl-pipeline")
    assert "ai.onnx.ml::ZipMap" in ops("skl-pipeline-zipmap")
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops("cnn-int8-qdq")
    assert {"QLinearConv", "com.microsoft::QLinearAdd"} <= ops("cnn-int8-qop")
    half = analyze(exported("cnn-fp16")[0])
    assert half.tensors[half.inputs[0]].dtype == "float16"
    zipmap = analyze(exported("skl-pipeline-zipmap")[0], input_shapes={"X": [3, 64]})
    probs = [t for t in zipmap.outputs if not zipmap.tensors[t].dense]
    assert probs and zipmap.tensors[probs[0]].dtype.startswith("seq(map(")


def test_int8_partitions_keep_their_domains(exported) -> None:
    """Partitions of the QOperator model carry com.microsoft nodes intact, with the opset."""
    path, _ = exported("cnn-int8-qop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        parts = Partitioner(analyze(path)).split_into(3)
    domains = set()
    for part in parts:
        m = part.load()
        domains |= {n.domain for n in m.graph.node}
        assert {o.domain for o in m.opset_import} >= {n.domain or "" for n in m.graph.node}
    assert "com.microsoft" in domains


def test_dynamo_export_from_another_directory(exported, tmp_path: Path, monkeypatch,
                                              chain_runner) -> None:
    """External data is read next to the model file, whatever the working directory."""
    path, _ = exported("torch-cnn-dynamo")
    monkeypatch.chdir(tmp_path)
    parts = Partitioner(analyze(path)).split_into(2)
    for part in parts:  # self-contained: weights inline, no reference to the side file
        assert all(not t.external_data for t in part.load().graph.initializer)
    feeds = feeds_for(analyze(path), seed=2)
    ref = _run_file(path, feeds)
    env = chain_runner(parts, feeds)
    assert max(rel_diff(env[n], v) for n, v in ref.items()) <= TOL


def test_bytes_of_an_external_data_model_need_the_file(exported) -> None:
    path, _ = exported("torch-cnn-dynamo")
    with pytest.raises(ModelError) as info:
        analyze(io.BytesIO(path.read_bytes()).getvalue())
    assert "\n" not in str(info.value)

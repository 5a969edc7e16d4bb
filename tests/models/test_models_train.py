"""Numpy trainers learn digits, split data as asked, and export identical ONNX models."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from models import zoo
from models.digits import load_digits_split
from models.errors import ModelError
from models.train import MLP, SoftmaxRegression, split_dataset, to_onnx


@pytest.fixture(scope="module")
def digits():
    return load_digits_split(4, iid=True, seed=0)


@pytest.mark.parametrize(("cls", "min_acc"), [(SoftmaxRegression, 0.9), (MLP, 0.9)])
def test_trainers_learn(cls, min_acc: float, digits) -> None:
    X = np.concatenate([c[0] for c in digits.clients])
    y = np.concatenate([c[1] for c in digits.clients])
    model = cls(seed=0)
    before = model.evaluate(*digits.test)
    metrics = model.fit(X, y, epochs=8, lr=0.1, momentum=0.9)
    loss, acc = model.evaluate(*digits.test)
    assert loss < before[0] and acc >= min_acc
    assert 0 <= metrics["accuracy"] <= 1 and metrics["loss"] > 0


@pytest.mark.parametrize("cls", [SoftmaxRegression, MLP])
def test_weights_roundtrip_and_fedavg_shape(cls, digits) -> None:
    a, b = cls(seed=1), cls(seed=2)
    a.fit(*digits.clients[0], epochs=1)
    w = a.get_weights()
    assert all(isinstance(x, np.ndarray) for x in w)
    b.set_weights(w)
    assert all(np.array_equal(x, y) for x, y in zip(b.get_weights(), w))
    w[0][...] = 0  # get_weights returns copies
    assert not np.array_equal(a.get_weights()[0], w[0])
    with pytest.raises(ModelError, match="do not fit"):
        b.set_weights(w[:-1])


def test_mlp_matches_zoo_layout() -> None:
    z = [onnx.numpy_helper.to_array(t) for t in zoo.build("mlp", seed=5).graph.initializer]
    m = MLP(seed=5).get_weights()
    assert [x.shape for x in z] == [x.shape for x in m]
    assert all(np.allclose(x, y) for x, y in zip(z, m))


@pytest.mark.parametrize("cls", [SoftmaxRegression, MLP])
def test_to_onnx_predictions_match(cls, digits, bytes_runner) -> None:
    model = cls(seed=0)
    model.fit(*digits.clients[1], epochs=3, lr=0.1)
    proto = to_onnx(model.get_weights())
    onnx.checker.check_model(proto)
    X, _ = digits.test
    got = bytes_runner(proto.SerializeToString(), {"x": X})["logits"]
    assert np.array_equal(got.argmax(axis=1), model.predict(X))
    assert np.abs(got - model.logits(X)).max() < 1e-4


def test_exported_model_profiles_once_batch_is_pinned() -> None:
    from models.profile import profile_model

    proto = to_onnx(MLP().get_weights())
    with pytest.raises(ModelError, match="dynamic shape"):
        profile_model(proto)
    assert profile_model(to_onnx(MLP().get_weights(), batch=1)).macs == 64 * 32 + 32 * 10


def test_iid_split_covers_train_set() -> None:
    split = load_digits_split(5, seed=3)
    sizes = [len(y) for _, y in split.clients]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) + len(split.test[1]) == 1797
    assert split.clients[0][0].dtype == np.float32 and split.clients[0][0].max() <= 1.0
    again = load_digits_split(5, seed=3)
    assert np.array_equal(again.clients[2][1], split.clients[2][1])


def test_dirichlet_split_skews_labels() -> None:
    skew = load_digits_split(6, alpha=0.1, seed=0)
    flat = load_digits_split(6, alpha=100.0, seed=0)

    def top_share(parts) -> float:
        return float(np.mean([np.bincount(y, minlength=10).max() / len(y) for _, y in parts]))

    assert top_share(skew.clients) > top_share(flat.clients) + 0.2
    assert all(len(y) >= 2 for _, y in skew.clients)
    assert sum(len(y) for _, y in skew.clients) == sum(len(y) for _, y in flat.clients)
    clients, test = load_digits_split(3, iid=False, seed=1)  # unpacks like a tuple
    assert len(clients) == 3 and len(test[0]) == len(test[1])


@pytest.mark.parametrize(("kw", "match"), [({"n_clients": 0}, "n_clients"),
                                           ({"n_clients": 2, "alpha": 0.0}, "alpha"),
                                           ({"n_clients": 5000}, "cannot fill"),
                                           ({"n_clients": 2, "test_fraction": 1.0}, "test")])
def test_bad_split_arguments(kw: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        load_digits_split(**kw)


def test_split_dataset_takes_any_arrays() -> None:
    """The pure split: arrays in (no scikit-learn), every sample used once, same seed same split."""
    X = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.arange(100, dtype=np.int64) % 4
    clients, (Xte, yte) = split_dataset(X, y, 3, alpha=1.0, seed=5, test_fraction=0.25)
    assert len(Xte) == 25 and len(yte) == 25
    seen = np.concatenate([Xte[:, 0]] + [cx[:, 0] for cx, _ in clients])
    assert sorted(seen.tolist()) == X[:, 0].tolist()
    again = split_dataset(X, y, 3, alpha=1.0, seed=5, test_fraction=0.25)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(clients, again.clients, strict=True))
    with pytest.raises(ModelError, match="100 samples but 99 labels"):
        split_dataset(X, y[:99], 3)


@pytest.mark.integration
def test_sklearn_is_imported_lazily() -> None:
    code = ("import sys, models.train, models.zoo, models.partition, models.cli; "
            "bad = [m for m in ('sklearn', 'onnxruntime', 'paho', 'flwr', 'socket', 'threading')"
            " if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # socket/threading can come in through third-party imports; sklearn must not.
    assert "sklearn" not in out.stdout and "onnxruntime" not in out.stdout

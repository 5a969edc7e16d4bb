"""Numpy trainers for federated learning on 8x8 digits, and their export to ONNX.

Weights are ``list[np.ndarray]`` (Flower's NDArrays) in the zoo MLP's layout:
``[W1 (in,h), b1, W2 (h,out), b2]`` for ``MLP`` and ``[W (in,out), b]`` for
``SoftmaxRegression``, so ``to_onnx(weights)`` is the model the fog serves.
Pure: the data comes in as arrays (``split_dataset``); ``models.digits`` loads scikit-learn's digits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import onnx

from models.errors import ModelError

__all__ = ["MLP", "DigitsSplit", "SoftmaxRegression", "split_dataset", "to_onnx"]

Weights = list[np.ndarray]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    p: np.ndarray = e / e.sum(axis=1, keepdims=True)
    return p


def _check_xy(X: np.ndarray, y: np.ndarray, n_features: int) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(X, dtype=np.float32)
    y = np.asarray(y, dtype=np.int64)
    if X.ndim != 2 or X.shape[1] != n_features:
        raise ModelError(f"X must have shape (n, {n_features}), got {X.shape}")
    if y.shape != (X.shape[0],):
        raise ModelError(f"y must have shape ({X.shape[0]},), got {y.shape}")
    return X, y


class _Trainer:
    """Minibatch SGD with momentum over a model given by forward/backward."""

    __slots__ = ("_rng", "_v", "_w", "batch_size", "n_classes", "n_features")

    def __init__(self, weights: Weights, *, seed: int, batch_size: int) -> None:
        self._w: Weights = [np.asarray(w, dtype=np.float32) for w in weights]
        self._v: Weights = [np.zeros_like(w) for w in self._w]
        self._rng = np.random.default_rng(seed)
        self.batch_size = batch_size
        self.n_features = self._w[0].shape[0]
        self.n_classes = self._w[-1].shape[0]

    def get_weights(self) -> Weights:
        return [w.copy() for w in self._w]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Load global weights; the momentum restarts since the starting point moved."""
        if len(weights) != len(self._w) or any(
                np.shape(a) != b.shape for a, b in zip(weights, self._w)):
            raise ModelError(
                f"weights do not fit this model: expected shapes "
                f"{[w.shape for w in self._w]}, got {[np.shape(a) for a in weights]}"
            )
        self._w = [np.array(w, dtype=np.float32) for w in weights]
        self._v = [np.zeros_like(w) for w in self._w]

    def _forward(self, X: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        raise NotImplementedError

    def _backward(self, cache: tuple[np.ndarray, ...], dz: np.ndarray) -> Weights:
        raise NotImplementedError

    def logits(self, X: np.ndarray) -> np.ndarray:
        return self._forward(np.asarray(X, dtype=np.float32))[0]

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        return _softmax(self.logits(X))

    def predict(self, X: np.ndarray) -> np.ndarray:
        labels: np.ndarray = self.logits(X).argmax(axis=1)
        return labels

    def fit(self, X: np.ndarray, y: np.ndarray, epochs: int = 1, lr: float = 0.1,
            momentum: float = 0.9) -> dict[str, float]:
        """Train in place; returns the last epoch's mean loss and training accuracy."""
        X, y = _check_xy(X, y, self.n_features)
        if epochs < 0 or lr <= 0 or not 0 <= momentum < 1:
            raise ModelError("need epochs >= 0, lr > 0 and 0 <= momentum < 1")
        n = len(X)
        loss_sum, correct = 0.0, 0
        for _ in range(epochs):
            loss_sum, correct = 0.0, 0
            order = self._rng.permutation(n)
            for s in range(0, n, self.batch_size):
                idx = order[s:s + self.batch_size]
                z, cache = self._forward(X[idx])
                p = _softmax(z)
                yb = y[idx]
                loss_sum += float(-np.log(p[np.arange(len(idx)), yb] + 1e-12).sum())
                correct += int((z.argmax(axis=1) == yb).sum())
                p[np.arange(len(idx)), yb] -= 1.0
                grads = self._backward(cache, p / len(idx))
                for w, v, g in zip(self._w, self._v, grads):
                    v *= momentum
                    v -= lr * g.astype(np.float32)
                    w += v
        return {"loss": loss_sum / max(n, 1), "accuracy": correct / max(n, 1)}

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on ``(X, y)``."""
        X, y = _check_xy(X, y, self.n_features)
        if len(X) == 0:
            return 0.0, 0.0
        z = self.logits(X)
        p = _softmax(z)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        return loss, float((z.argmax(axis=1) == y).mean())


class SoftmaxRegression(_Trainer):
    """Multinomial logistic regression: logits = X W + b."""

    __slots__ = ()

    def __init__(self, n_features: int = 64, n_classes: int = 10, *, seed: int = 0,
                 batch_size: int = 32) -> None:
        super().__init__([np.zeros((n_features, n_classes)), np.zeros(n_classes)],
                         seed=seed, batch_size=batch_size)

    def _forward(self, X: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        return X @ self._w[0] + self._w[1], (X,)

    def _backward(self, cache: tuple[np.ndarray, ...], dz: np.ndarray) -> Weights:
        (X,) = cache
        return [X.T @ dz, dz.sum(axis=0)]


class MLP(_Trainer):
    """One hidden ReLU layer; ``MLP(seed=s)`` starts from ``zoo.build("mlp", seed=s)``."""

    __slots__ = ()

    def __init__(self, n_features: int = 64, hidden: int = 32, n_classes: int = 10, *,
                 seed: int = 0, batch_size: int = 32) -> None:
        rng = np.random.default_rng(seed)  # same draws, same order as zoo._mlp
        weights = [
            rng.normal(0, np.sqrt(2 / n_features), (n_features, hidden)),
            np.zeros(hidden),
            rng.normal(0, np.sqrt(2 / hidden), (hidden, n_classes)),
            np.zeros(n_classes),
        ]
        super().__init__(weights, seed=seed, batch_size=batch_size)

    def _forward(self, X: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        pre = X @ self._w[0] + self._w[1]
        h = np.maximum(pre, 0.0)
        return h @ self._w[2] + self._w[3], (X, pre, h)

    def _backward(self, cache: tuple[np.ndarray, ...], dz: np.ndarray) -> Weights:
        X, pre, h = cache
        dh = (dz @ self._w[2].T) * (pre > 0)
        return [X.T @ dh, dh.sum(axis=0), h.T @ dz, dz.sum(axis=0)]


class DigitsSplit(NamedTuple):
    """Per-client ``(X, y)`` shards plus a held-out test set."""

    clients: list[tuple[np.ndarray, np.ndarray]]
    test: tuple[np.ndarray, np.ndarray]


def _dirichlet_parts(y: np.ndarray, n_clients: int, alpha: float,
                     rng: np.random.Generator, min_size: int) -> list[np.ndarray]:
    classes = np.unique(y)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            p = rng.dirichlet(np.full(n_clients, alpha))
            bounds = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, bounds)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p), dtype=np.int64) for p in parts]
    raise ModelError(
        f"could not give each of {n_clients} clients {min_size} samples with alpha={alpha}; "
        f"use fewer clients or a larger alpha"
    )


def split_dataset(X: np.ndarray, y: np.ndarray, n_clients: int, *, iid: bool = True,
                  alpha: float | None = None, seed: int = 0, test_fraction: float = 0.2,
                  min_size: int = 2) -> DigitsSplit:
    """Samples ``X`` with labels ``y`` split into a held-out test set and per-client shards.

    ``alpha`` (Dirichlet concentration, smaller is more skewed) selects a label-skew
    split; otherwise ``iid=True`` deals samples uniformly at random. ``iid=False``
    without ``alpha`` means ``alpha=0.5``. Deterministic for a given ``seed``.
    """
    if len(X) != len(y):
        raise ModelError(f"{len(X)} samples but {len(y)} labels")
    if n_clients < 1:
        raise ModelError(f"n_clients must be >= 1, got {n_clients}")
    if alpha is not None and not alpha > 0:
        raise ModelError(f"alpha must be > 0, got {alpha}")
    if not 0 < test_fraction < 1:
        raise ModelError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = round(test_fraction * len(y))
    test_idx, train_idx = order[:n_test], order[n_test:]
    Xtr, ytr = X[train_idx], y[train_idx]
    if n_clients * min_size > len(ytr):
        raise ModelError(f"{len(ytr)} training samples cannot fill {n_clients} clients")
    if alpha is None and not iid:
        alpha = 0.5
    if alpha is None:
        parts = np.array_split(rng.permutation(len(ytr)), n_clients)
    else:
        parts = _dirichlet_parts(ytr, n_clients, alpha, rng, min_size)
    clients = [(Xtr[p], ytr[p]) for p in parts]
    return DigitsSplit(clients, (X[test_idx], y[test_idx]))


def to_onnx(weights: Sequence[np.ndarray], *, batch: int | None = None,
            name: str | None = None) -> onnx.ModelProto:
    """ONNX model computing the trainer's logits (output ``logits``, input ``x``).

    Two arrays export a softmax regression (one Gemm), four the MLP; ``batch=None``
    leaves the batch dimension symbolic (``N``), which profiling needs pinned.
    """
    from models.zoo import mlp_from_weights

    default = "softmax_regression" if len(weights) == 2 else "mlp"
    return mlp_from_weights(weights, batch=batch, name=name or default)

"""wine_app: the data (standardised wine features, a held-out split, IID partitions) and the model."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from sklearn.datasets import load_wine

FEATURES, CLASSES = 13, 3


@lru_cache(maxsize=4)
def _split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 30 % held out per class, standardised on the training split."""
    x, y = load_wine(return_X_y=True)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(CLASSES):
        idx = np.flatnonzero(y == c)
        test[rng.choice(idx, size=round(0.3 * len(idx)), replace=False)] = True
    mean, std = x[~test].mean(0), x[~test].std(0) + 1e-12
    x = (x - mean) / std
    return x[~test], y[~test], x[test], y[test]


def partition(seed: int, pid: int, nparts: int) -> tuple[np.ndarray, np.ndarray]:
    """IID partition ``pid`` of ``nparts`` of the training split."""
    x, y, _, _ = _split(seed)
    order = np.random.default_rng(seed + 1).permutation(len(y))
    part = np.array_split(order, nparts)[pid % nparts]
    return x[part], y[part]


def held_out(seed: int) -> tuple[np.ndarray, np.ndarray]:
    _, _, x, y = _split(seed)
    return x, y


def initial() -> list[np.ndarray]:
    return [np.zeros((FEATURES, CLASSES)), np.zeros(CLASSES)]


def _probs(w: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    z = x @ w[0] + w[1]
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    return np.asarray(e / e.sum(1, keepdims=True))


def fit(w: list[np.ndarray], x: np.ndarray, y: np.ndarray, epochs: int, lr: float) -> list[np.ndarray]:
    """Full-batch gradient descent on the cross-entropy."""
    wt, b = w[0].copy(), w[1].copy()
    onehot = np.eye(CLASSES)[y]
    for _ in range(epochs):
        g = (_probs([wt, b], x) - onehot) / len(y)
        wt -= lr * (x.T @ g)
        b -= lr * g.sum(0)
    return [wt, b]


def score(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(cross-entropy loss, accuracy)."""
    p = _probs(w, x)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12)))
    return loss, float(np.mean(p.argmax(1) == y))

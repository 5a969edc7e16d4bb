"""scikit-learn's bundled 8x8 digits (offline), split over clients: the loading shell of ``models.train``.

The trainers and the split are pure (``models.train``); reading the dataset's files is here.
"""
from __future__ import annotations

import numpy as np

from models.train import DigitsSplit, split_dataset

__all__ = ["load_digits_arrays", "load_digits_split"]


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(X, y): 1797 samples of 64 pixels scaled to [0, 1] (float32), labels 0-9 (int64)."""
    from sklearn.datasets import load_digits  # heavy; imported only when the data is wanted

    data = load_digits()
    X = (np.asarray(data.data, dtype=np.float32) / 16.0).astype(np.float32)
    return X, np.asarray(data.target, dtype=np.int64)


def load_digits_split(n_clients: int, *, iid: bool = True, alpha: float | None = None,
                      seed: int = 0, test_fraction: float = 0.2,
                      min_size: int = 2) -> DigitsSplit:
    """The digits split over ``n_clients`` (see ``models.train.split_dataset`` for the options)."""
    X, y = load_digits_arrays()
    return split_dataset(X, y, n_clients, iid=iid, alpha=alpha, seed=seed,
                         test_fraction=test_fraction, min_size=min_size)

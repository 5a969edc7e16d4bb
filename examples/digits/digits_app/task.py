"""Model, data and export of the digits app (numpy trainers from ``models.train``).

Server and clients build the same split (same seed, same partitioning) and the
same initial weights. The split is cached on disk per device: Flower starts a
ClientApp process per message, and loading digits through scikit-learn costs
seconds of CPU on a small device; the cache makes it one ``np.load``.
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from models.digits import load_digits_split
from models.train import MLP, SoftmaxRegression
from models.train import to_onnx as _weights_to_onnx

N_FEATURES, N_CLASSES = 64, 10


def _cache_dir() -> Path:
    return Path(os.environ.get("FOGLINE_CACHE_DIR") or Path.home() / ".cache" / "fogline")


@lru_cache(maxsize=4)
def split(n: int, iid: bool, alpha: float, seed: int) -> tuple[tuple[tuple[np.ndarray, np.ndarray], ...],
                                                                  tuple[np.ndarray, np.ndarray]]:
    """Per-partition (x, y) and the held-out test set."""
    path = _cache_dir() / f"digits-{n}-{int(iid)}-{alpha}-{seed}.npz"
    try:
        with np.load(path) as z:
            return tuple((z[f"x{i}"], z[f"y{i}"]) for i in range(n)), (z["xt"], z["yt"])
    except (OSError, KeyError, ValueError):
        pass
    data = load_digits_split(n, iid=iid, alpha=None if iid else alpha, seed=seed)
    clients = tuple((np.asarray(x), np.asarray(y)) for x, y in data.clients)
    test = (np.asarray(data.test[0]), np.asarray(data.test[1]))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.npz")
        arrays = {f"{k}{i}": v for i, (x, y) in enumerate(clients) for k, v in (("x", x), ("y", y))}
        np.savez(tmp, xt=test[0], yt=test[1], **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs speed
    return clients, test


def data_of(run_config: Any, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    clients, _ = split(num_partitions, bool(run_config["iid"]), float(run_config["alpha"]), int(run_config["seed"]))
    if not 0 <= partition_id < len(clients):
        raise ValueError(f"partition-id {partition_id} outside 0..{len(clients) - 1}")
    return clients[partition_id]


def test_set(run_config: Any) -> tuple[np.ndarray, np.ndarray]:
    return split(int(run_config["num-partitions"]), bool(run_config["iid"]), float(run_config["alpha"]),
                 int(run_config["seed"]))[1]


def build(run_config: Any, seed: int | None = None) -> SoftmaxRegression | MLP:
    """A trainer; ``seed`` drives its minibatch order (the client's seed of the round)."""
    cls = {"softmax": SoftmaxRegression, "mlp": MLP}.get(str(run_config["model"]))
    if cls is None:
        raise ValueError(f"unknown model {run_config['model']!r}; choose softmax or mlp")
    return cls(n_features=N_FEATURES, n_classes=N_CLASSES,
               seed=int(run_config["seed"]) if seed is None else seed, batch_size=int(run_config["batch-size"]))


def client_seed(global_seed: int, server_round: int, partition_id: int) -> int:
    """A 31-bit seed for one client's local training in one round (stable across restarts)."""
    digest = hashlib.sha256(f"digits/{global_seed}/{server_round}/{partition_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def to_onnx(arrays: ArrayRecord) -> bytes:
    """The export hook (``[tool.fogline] export``): global arrays -> the ONNX the fog serves."""
    weights = [np.asarray(a, dtype=np.float32) for a in arrays.to_numpy_ndarrays()]
    return _weights_to_onnx(weights, batch=1).SerializeToString()  # type: ignore[no-any-return]

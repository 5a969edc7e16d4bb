"""The one adapter between federated rounds and ``models.train`` (numpy trainers on digits).

Server and clients both go through it, so they agree on the data split
(same seed, same partitioning), the model architecture and the initial
weights. Splits are cached per process: a ClientApp handles many rounds.
"""
from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import LocalViolation

from .rounds import RunConfig

__all__ = ["DigitsModelOps", "build_model", "client_data", "test_data", "local_train", "MODEL_MODULE"]

MODEL_MODULE = "models.train"


def _mod(module: str = MODEL_MODULE) -> Any:
    return importlib.import_module(module)


def _xy(obj: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(obj, tuple) and len(obj) == 2:
        return np.asarray(obj[0]), np.asarray(obj[1])
    return np.asarray(obj.X if hasattr(obj, "X") else obj.x), np.asarray(obj.y)


def _cache_dir() -> Path:
    return Path(os.environ.get("FOGLINE_CACHE_DIR") or Path.home() / ".cache" / "fogline")


@lru_cache(maxsize=4)
def _split(n: int, iid: bool, alpha: float, seed: int, module: str) -> tuple[Any, ...]:
    """The data split, from a per-device disk cache when present.

    Flower starts a fresh ClientApp process per message, and building the split
    (loading digits through scikit-learn) costs seconds of CPU per round on a
    small device; the cache turns that into one ``np.load``.
    """
    path = _cache_dir() / f"digits-{module}-{n}-{int(iid)}-{alpha}-{seed}.npz"
    try:
        with np.load(path) as z:
            clients = tuple((z[f"x{i}"], z[f"y{i}"]) for i in range(n))
            return clients, (z["xt"], z["yt"])
    except (OSError, KeyError, ValueError):
        pass
    clients, test = _build_split(n, iid, alpha, seed, module)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.npz")
        arrays = {f"{k}{i}": v for i, (x, y) in enumerate(clients) for k, v in (("x", x), ("y", y))}
        np.savez(tmp, xt=test[0], yt=test[1], **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs speed
    return clients, test


def _build_split(n: int, iid: bool, alpha: float, seed: int, module: str) -> tuple[Any, ...]:
    split = _mod(module).load_digits_split(n, iid=iid, alpha=None if iid else alpha, seed=seed)
    if isinstance(split, tuple) and len(split) == 2 and isinstance(split[0], (list, tuple)):
        clients, test = split
    else:
        clients = getattr(split, "clients", None)
        if clients is None:
            clients = split.train
        test = split.test
    return tuple(_xy(c) for c in clients), _xy(test)


def client_data(cfg: RunConfig, partition_id: int, module: str = MODEL_MODULE) -> tuple[np.ndarray, np.ndarray]:
    clients, _ = _split(cfg.num_partitions, cfg.iid, cfg.alpha, cfg.seed, module)
    if not 0 <= partition_id < len(clients):
        raise LocalViolation(f"partition-id {partition_id} outside 0..{len(clients) - 1}")
    return clients[partition_id]  # type: ignore[no-any-return]


def test_data(cfg: RunConfig, module: str = MODEL_MODULE) -> tuple[np.ndarray, np.ndarray]:
    return _split(cfg.num_partitions, cfg.iid, cfg.alpha, cfg.seed, module)[1]  # type: ignore[no-any-return]


def build_model(cfg: RunConfig, n_features: int, n_classes: int, module: str = MODEL_MODULE,
                seed: int | None = None) -> Any:
    """A trainer; ``seed`` drives its minibatch order (the client seed of the round)."""
    m = _mod(module)
    cls = {"softmax": m.SoftmaxRegression, "mlp": m.MLP}.get(cfg.model)
    if cls is None:
        raise LocalViolation(f"unknown model {cfg.model!r}; choose softmax or mlp")
    return cls(n_features=n_features, n_classes=n_classes, seed=cfg.seed if seed is None else seed,
               **({"batch_size": cfg.batch_size} if "batch_size" in inspect.signature(cls).parameters else {}))


def _shape(cfg: RunConfig, module: str) -> tuple[int, int]:
    x, y = test_data(cfg, module)
    return int(x.shape[1]), 10


def local_train(cfg: RunConfig, weights: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, seed: int,
                module: str = MODEL_MODULE) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
    """One client's local epochs from the global weights; deterministic given ``seed``."""
    model = build_model(cfg, int(x.shape[1]), 10, module, seed=seed)
    model.set_weights([np.array(w, copy=True) for w in weights])
    out = model.fit(x, y, epochs=cfg.local_epochs, lr=cfg.lr)
    metrics: dict[str, float] = {}
    if isinstance(out, dict):
        metrics = {k: float(v) for k, v in out.items() if isinstance(v, (int, float, np.floating))}
    elif isinstance(out, (int, float, np.floating)):
        metrics = {"train_loss": float(out)}
    return tuple(np.asarray(w) for w in model.get_weights()), metrics


class DigitsModelOps:
    """Initial weights and central evaluation on the held-out digits test split."""

    __slots__ = ("module",)

    def __init__(self, module: str = MODEL_MODULE) -> None:
        self.module = module

    def initial_weights(self, cfg: RunConfig) -> tuple[np.ndarray, ...]:
        nf, nc = _shape(cfg, self.module)
        return tuple(np.asarray(w) for w in build_model(cfg, nf, nc, self.module).get_weights())

    def evaluate(self, weights: Sequence[np.ndarray], cfg: RunConfig) -> dict[str, float]:
        x, y = test_data(cfg, self.module)
        model = build_model(cfg, int(x.shape[1]), 10, self.module)
        model.set_weights([np.asarray(w) for w in weights])
        out = model.evaluate(x, y)
        if isinstance(out, dict):
            return {k: float(v) for k, v in out.items() if isinstance(v, (int, float, np.floating))}
        if isinstance(out, tuple) and len(out) == 2:
            return {"loss": float(out[0]), "accuracy": float(out[1])}
        return {"accuracy": float(out)}

"""An in-process Flower Grid for strategy tests: each node is a Python function, no processes.

Like httpx's ``MockTransport``: the strategy talks to a real ``flwr.serverapp.Grid``
subclass; messages and replies are real Flower ``Message`` objects (replies made with
``Message(content, reply_to=msg)`` exactly as a ClientApp makes them). Nodes may
answer late (``delay`` pulls), never, or crash mid-run (``crash_on``).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import numpy as np
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

Client = Callable[[Message], RecordDict | Error | None]


class Crash(Exception):
    """Stands in for a kill -9 of the ServerApp in the middle of a round."""


@dataclass
class _Node:
    fn: Client
    public_key: bytes = b""
    delay: int = 0


@dataclass
class NodeInfoLike:
    node_id: int
    public_key: bytes
    name: str = ""


class LocalGrid(Grid):
    def __init__(self, run_config: dict[str, Any] | None = None) -> None:
        TaskIdentity.run_id = 1  # what the ServerApp runtime sets before main() runs
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 1
        self.nodes: dict[int, _Node] = {}
        self._ids = itertools.count(101)
        self._pending: dict[str, tuple[int, Message]] = {}  # instruction id -> (pulls left, reply)
        self.pushed: list[Message] = []
        self.crash_on: tuple[int, int] | None = None  # (server round, attempt) when pushing raises Crash
        self.run_config = dict(run_config or {})

    # -- test API
    def add(self, fn: Client, *, public_key: bytes = b"", delay: int = 0, node_id: int | None = None) -> int:
        nid = next(self._ids) if node_id is None else node_id
        self.nodes[nid] = _Node(fn, public_key, delay)
        return nid

    # -- Grid API
    @property
    def run(self) -> Any:  # type: ignore[override]
        return type("Run", (), {"override_config": self.run_config, "run_id": 1})()

    def set_run(self, run_id: int) -> None:  # pragma: no cover - not used by the strategy
        pass

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # pragma: no cover
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def get_nodes(self) -> Iterable[Any]:
        return [NodeInfoLike(n, node.public_key) for n, node in self.nodes.items()]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            if self.crash_on is not None and int(msg.metadata.group_id or 0) == self.crash_on[0]:
                raise Crash(f"killed in round {msg.metadata.group_id}")
            mid = str(uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            node = self.nodes.get(msg.metadata.dst_node_id)
            ids.append(mid)
            if node is None:
                continue
            out = node.fn(msg)
            if out is None:
                continue
            reply = Message(out, reply_to=msg)
            self._pending[mid] = (node.delay, reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        got = []
        for mid in list(message_ids):
            if mid not in self._pending:
                continue
            left, reply = self._pending[mid]
            if left > 0:
                self._pending[mid] = (left - 1, reply)
                continue
            got.append(self._pending.pop(mid)[1])
        return got

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        out: list[Message] = []
        for _ in range(50):  # replies that are late by k pulls arrive within k + 1 rounds of pulling
            out.extend(self.pull_messages(ids))
        return out


def pull_client(target: np.ndarray, lr: float = 0.5, *, attack: str = "", examples: Any = 10,
                noise_seed: int = 0) -> Client:
    """A client whose training pulls each array towards ``target`` (same value in every array)."""
    def fn(msg: Message) -> RecordDict:
        arrays = msg.content["arrays"]
        rnd = int(msg.content["config"]["server-round"])
        rng = np.random.default_rng([noise_seed, rnd])
        out = {}
        for name, a in arrays.items():
            w = a.numpy()
            new = w + lr * (target - w) + rng.normal(0, 0.01, w.shape)
            if attack == "sign-flip":
                new = w - 100.0 * (new - w)
            elif attack == "nan":
                new = np.full_like(new, np.nan)
            out[name] = Array(np.asarray(new).astype(w.dtype))
        return RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": examples,
                                                                               "train_loss": 1.0})})
    return fn


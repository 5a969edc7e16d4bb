"""Helpers for tests, benchmarks and demos: a fog signer and a tiny two-partition ONNX chain.

``FogSigner`` plays the fog broker's side of the control protocol (sealed
FogState, signed Deploy / Undeploy / Rebirth) with ``runtime.security``
directly, so the agent can be exercised without the real fog broker. Agents
pin its key explicitly (``agent_args()``: ``--fog-key HEX --insecure``, or
``AgentConfig(fog_key=signer.public_key)``), as they would after enrolment.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from runtime import relay
from runtime.messages import (
    Activation,
    Deploy,
    FogState,
    Hop,
    Message,
    Rebirth,
    RouteTicket,
    Undeploy,
)
from runtime.security import Identity, Signer, sign_artifact

__all__ = ["FogSigner", "tiny_chain", "TinyChain"]


class FogSigner:
    """The fog broker's identity and envelope signer, for tests."""

    def __init__(self, fog_id: str = "fog-test", site: str = "default", identity: Identity | None = None,
                 epoch: int = 1) -> None:
        self.fog_id = fog_id
        self.site = site
        self.identity = identity or Identity.generate(fog_id)
        self.epoch = epoch
        self.signer = Signer(self.identity, epoch)

    @property
    def public_key(self) -> bytes:
        return self.identity.public_key_bytes

    def agent_args(self) -> list[str]:
        """Command-line flags of an agent that pins this fog's key on a plain loopback broker."""
        return ["--fog-key", self.public_key.hex(), "--insecure"]

    def fog_state(self, online: bool = True, epoch: int | None = None) -> bytes:
        """The retained ``fog/STATE``: an envelope sealed by the fog for that fog epoch (docs/security.md)."""
        epoch = self.epoch if epoch is None else epoch
        now = time.time()
        state = FogState(self.fog_id, self.site, online, epoch, self.public_key, now)
        return Signer(self.identity, epoch).seal_bytes(state, now)

    def ticketed(self, act: Activation, keys: Mapping[str, bytes]) -> Activation:
        """``act`` with the route ticket this fog signs for it (``keys``: each hop's device key)."""
        ticket = RouteTicket(self.fog_id, act.request_id, act.workload, act.route,
                             tuple(keys.get(h.device_id, bytes(32)) for h in act.route), act.reply_to, act.deadline)
        raw, sig = relay.issue_ticket(self.identity, ticket)
        return dataclasses.replace(act, ticket=raw, ticket_sig=sig, keys=ticket.keys)

    def frame(self, act: Activation, keys: Mapping[str, bytes]) -> bytes:
        """The wire frame of hop 0, as the fog sends it to the first device."""
        return relay.seal(self.identity, self.ticketed(act, keys))

    def seal(self, msg: Message, now: float | None = None) -> bytes:
        return self.signer.seal_bytes(msg, time.time() if now is None else now)

    def deploy(self, command_id: str, artifact: bytes, *, workload: str = "wl", version: int = 1, replica: int = 0,
               index: int = 0, memory_bytes: int = 1_000_000, inputs: tuple[str, ...] = (),
               outputs: tuple[str, ...] = (), signer: Identity | None = None, send_artifact: bool = True) -> Deploy:
        meta = {"workload": workload, "version": str(version), "replica": str(replica), "index": str(index)}
        sig = sign_artifact(signer or self.identity, artifact, meta)
        return Deploy(command_id, workload, version, replica, index, sig.sha256,
                      artifact if send_artifact else b"", sig.signature, sig.signer, memory_bytes,
                      inputs, outputs, dict(sig.metadata))

    def undeploy(self, command_id: str, *, workload: str = "wl", version: int = 1, replica: int = 0,
                 index: int = 0) -> Undeploy:
        return Undeploy(command_id, workload, version, replica, index)

    def rebirth(self, device_id: str = "") -> Rebirth:
        return Rebirth(device_id, "test")


class TinyChain:
    """A 2-layer MLP as one model and as two partitions cut at the hidden tensor ``h``."""

    def __init__(self, full: bytes, parts: list[bytes], weights: dict[str, np.ndarray]) -> None:
        self.full = full
        self.parts = parts
        self.weights = weights

    def reference(self, x: np.ndarray) -> np.ndarray:
        w = self.weights
        h = np.maximum(x @ w["w1"] + w["b1"], 0)
        return h @ w["w2"] + w["b2"]  # type: ignore[no-any-return]

    def activation(self, request_id: str, x: np.ndarray, route: list[tuple[str, int]], reply_to: str,
                   *, workload: str = "wl", version: int = 1, replica: int = 0, deadline: float = 0.0,
                   fog: FogSigner | None = None, keys: Mapping[str, bytes] | None = None) -> Activation:
        """Hop 0 of a request; with ``fog``, carrying its signed route ticket (``keys``: device -> key)."""
        hops = tuple(Hop(dev, workload, version, replica, idx) for dev, idx in route)
        act = Activation(request_id, workload, hops, 0, reply_to, {"x": x}, deadline)
        return fog.ticketed(act, keys or {}) if fog is not None else act


def tiny_chain(seed: int = 0, n_in: int = 8, n_hidden: int = 16, n_out: int = 4) -> TinyChain:
    """Build the models with onnx.helper (onnx imported here: tests and tools only)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = {"w1": rng.standard_normal((n_in, n_hidden)).astype(np.float32),
         "b1": rng.standard_normal(n_hidden).astype(np.float32),
         "w2": rng.standard_normal((n_hidden, n_out)).astype(np.float32),
         "b2": rng.standard_normal(n_out).astype(np.float32)}

    def vi(name: str, n: int) -> Any:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", n])

    first = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["h"])]
    second = [helper.make_node("MatMul", ["h", "w2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["y"])]

    def model(nodes: list[Any], inp: Any, out: Any, names: list[str]) -> bytes:
        inits = [numpy_helper.from_array(w[n], n) for n in names]
        graph = helper.make_graph(nodes, "tiny", [inp], [out], inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fogline-test")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return bytes(m.SerializeToString())

    full = model(first + second, vi("x", n_in), vi("y", n_out), ["w1", "b1", "w2", "b2"])
    p0 = model(first, vi("x", n_in), vi("h", n_hidden), ["w1", "b1"])
    p1 = model(second, vi("h", n_hidden), vi("y", n_out), ["w2", "b2"])
    return TinyChain(full, [p0, p1], w)

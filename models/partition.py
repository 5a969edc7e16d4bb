"""Extract partitions at chosen cuts and package them as hashed, optionally signed artifacts.

Partitions keep the original tensor names on their inputs and outputs, so a
chain runs by feeding each partition's outputs, by name, to the next one.
Shape inference runs once per model (in ``analyze``); ``onnx.utils.Extractor``
then cuts every partition from that one inferred graph.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
import onnx.utils

from models.cuts import ChainProfile, Cut, chain_profile, enumerate_cuts, resolve_cuts
from models.errors import ModelError
from models.graph import GraphAnalysis, ModelSource, TensorInfo, analyze
from models.profile import ModelProfile, profile_model

if TYPE_CHECKING:  # runtime.security is optional at import time
    from runtime.security import ArtifactSignature, Identity

__all__ = ["PartitionArtifact", "Partitioner", "split", "split_by_segments"]


@dataclass(frozen=True, slots=True)
class PartitionArtifact:
    """One partition: its ONNX bytes, their sha256, I/O signature, cost and signature."""

    index: int
    model: str
    onnx_bytes: bytes = field(repr=False)
    sha256: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    flops: int
    param_bytes: int
    activation_bytes: int  # peak live activations while it runs
    memory_bytes: int  # param_bytes + activation_bytes: what COST_MODEL.md calls memory need
    nodes: tuple[int, int]  # [start, end) in the source model's topological order
    segments: tuple[int, int] | None = None  # inclusive chain-profile range, if split by it
    signature: ArtifactSignature | None = None

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def load(self) -> onnx.ModelProto:
        return onnx.load_model_from_string(self.onnx_bytes)

    def manifest(self) -> dict[str, Any]:
        """JSON-ready description an edge agent checks before it deploys the bytes."""
        out: dict[str, Any] = {
            "index": self.index,
            "model": self.model,
            "sha256": self.sha256,
            "size_bytes": len(self.onnx_bytes),
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "flops": self.flops,
            "param_bytes": self.param_bytes,
            "activation_bytes": self.activation_bytes,
            "memory_bytes": self.memory_bytes,
            "nodes": list(self.nodes),
        }
        if self.segments is not None:
            out["segments"] = list(self.segments)
        if self.signature is not None:
            out["signature"] = self.signature.to_dict()
        return out


class Partitioner:
    """Holds one analysed model and its Extractor so many splits share the setup."""

    __slots__ = ("ga", "profile", "_names", "_extractor")

    def __init__(self, src: ModelSource) -> None:
        self.ga: GraphAnalysis = analyze(src)
        self.profile: ModelProfile = profile_model(self.ga)
        n = len(self.ga.nodes)
        cuts = enumerate_cuts(self.ga)
        # Tensors crossing each position 0..n: model inputs, every cut, model outputs.
        first = tuple(t for t in self.ga.inputs if t in self.ga.last_use)
        self._names: list[tuple[str, ...]] = [first, *(c.tensors for c in cuts),
                                              self.ga.outputs]
        assert len(self._names) == n + 1
        self._extractor = onnx.utils.Extractor(self.ga.model)

    def extract(self, index: int, start: int, end: int, *,
                segments: tuple[int, int] | None = None,
                signer: Identity | None = None) -> PartitionArtifact:
        """The partition running nodes ``[start, end)``; its I/O are the cuts around it."""
        ga, n = self.ga, len(self.ga.nodes)
        if not 0 <= start < end <= n:
            raise ModelError(f"node range [{start}, {end}) is invalid for a {n}-node model")
        ins, outs = list(self._names[start]), list(self._names[end])
        try:
            part = self._extractor.extract_model(ins, outs)
        except (ValueError, KeyError) as exc:
            raise ModelError(f"cannot extract nodes [{start}, {end}): {exc}") from None
        # Named by content, not list position, so the same nodes give the same sha256.
        part.graph.name = f"{ga.name}[{start}:{end}]"
        onnx.helper.set_model_props(part, {"fogline.source": ga.name,
                                           "fogline.nodes": f"{start}:{end}"})
        data = part.SerializeToString(deterministic=True)
        sha = hashlib.sha256(data).hexdigest()
        nodes = self.profile.nodes[start:end]
        params = sum(ga.tensors[t.name].nbytes for t in part.graph.initializer
                     if t.name in ga.tensors)
        params += sum(ga.tensors[o].nbytes for node in part.graph.node
                      if node.op_type == "Constant" for o in node.output if o in ga.tensors)
        act = max(x.live_bytes for x in nodes)
        signature = None
        if signer is not None:
            from runtime.security import sign_artifact

            signature = sign_artifact(signer, data, {
                "model": ga.name, "partition": index, "nodes": f"{start}:{end}",
            })
        return PartitionArtifact(
            index=index, model=ga.name, onnx_bytes=data, sha256=sha,
            inputs=tuple(ga.tensors[t] for t in ins),
            outputs=tuple(ga.tensors[t] for t in outs),
            flops=sum(x.flops for x in nodes), param_bytes=params,
            activation_bytes=act, memory_bytes=params + act,
            nodes=(start, end), segments=segments, signature=signature,
        )

    def split(self, cuts: Sequence[int | Cut | Iterable[str]], *,
              signer: Identity | None = None) -> list[PartitionArtifact]:
        points = [c.index for c in resolve_cuts(self.ga, cuts)]
        bounds = [0, *points, len(self.ga.nodes)]
        return [self.extract(i, a, b, signer=signer)
                for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def split(src: ModelSource, cuts: Sequence[int | Cut | Iterable[str]], *,
          signer: Identity | None = None) -> list[PartitionArtifact]:
    """Partitions between consecutive cuts (positions, Cuts or tensor-name sets)."""
    return Partitioner(src).split(cuts, signer=signer)


def _as_chain(p: Partitioner, chain: ChainProfile | Mapping[str, Any]) -> ChainProfile:
    if isinstance(chain, ChainProfile):
        if not chain.segments or chain.segments[-1].end != len(p.ga.nodes):
            raise ModelError(f"chain profile of '{chain.model}' does not match this model")
        return chain
    if not isinstance(chain, Mapping) or not isinstance(chain.get("segments"), list):
        raise ModelError("chain profile must be a ChainProfile or a dict with 'segments'")
    if isinstance(chain.get("cuts"), list):
        try:
            idx = [int(c["index"]) for c in chain["cuts"]]
        except (KeyError, TypeError, ValueError):
            raise ModelError("chain profile 'cuts' entries need an integer 'index'") from None
        rebuilt = chain_profile(p.ga, cuts=idx)
    else:
        rebuilt = chain_profile(p.ga, max(len(chain["segments"]), 1))
    if not rebuilt.matches(chain):
        raise ModelError("chain profile does not match this model (segments differ)")
    return rebuilt


def split_by_segments(src: ModelSource, chain: ChainProfile | Mapping[str, Any],
                      ranges: Sequence[tuple[int, int]], *,
                      signer: Identity | None = None) -> list[PartitionArtifact]:
    """Partitions for inclusive segment ranges ``[a, b]`` of a chain profile, in order.

    Ranges must be increasing and disjoint; they need not cover the whole chain,
    so a broker can extract only the partitions it deploys. ``chain`` may also be
    the profile dict (with or without its ``cuts``), checked against the model.
    """
    p = Partitioner(src)
    cp = _as_chain(p, chain)
    out: list[PartitionArtifact] = []
    prev = -1
    for i, rng in enumerate(ranges):
        try:
            a, b = (int(v) for v in rng)
        except (TypeError, ValueError):
            raise ModelError(f"segment range {rng!r} is not a pair of integers") from None
        if a <= prev:
            raise ModelError(f"segment range [{a}, {b}] overlaps or precedes the previous one")
        start, end = cp.node_range(a, b)
        out.append(p.extract(i, start, end, segments=(a, b), signer=signer))
        prev = b
    return out

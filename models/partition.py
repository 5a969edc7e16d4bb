"""Extract partitions at chosen cuts and package them as hashed, optionally signed artifacts.

Partitions keep the original tensor names on their inputs and outputs, so a
chain runs by feeding each partition's outputs, by name, to the next one.
Shapes are computed once per model (in ``analyze``); every partition is then cut
from that one analysed graph by walking back from its outputs over the fixed
topological order, so a node with subgraphs (If, Loop, Scan) brings along the
outer-scope tensors and weights its subgraphs read.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import onnx

from models.cuts import (
    ChainProfile,
    Cut,
    chain_profile,
    enumerate_cuts,
    max_partitions,
    resolve_cuts,
)
from models.errors import ModelError
from models.external import inline_only, location_of
from models.graph import (
    GraphAnalysis,
    ModelSource,
    TensorInfo,
    analyze,
    type_from_ort,
    uses_external_data,
)
from models.profile import ModelProfile, profile_model

if TYPE_CHECKING:  # runtime.verify is optional at import time
    from runtime.verify import ArtifactSignature, KeyPair

__all__ = ["PartitionArtifact", "Partitioner", "split", "split_by_segments", "split_into"]

# protobuf's limit on one message is 2 GiB; keep room for the graph around the weights.
_PROTO_LIMIT = 2**31 - 2**24


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

    __slots__ = ("_functions", "_inits", "_names", "_order", "ga", "profile")

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
        g = self.ga.model.graph
        self._inits = {t.name: t for t in g.initializer}
        self._order = {name: i for i, name in enumerate(self._inits)}
        self._functions = {(f.name, f.domain): f for f in self.ga.model.functions}

    def _io_info(self, name: str) -> onnx.ValueInfoProto:
        """Declared type of a partition input/output: what the model itself implies.

        Dims the exported model leaves open stay open (a batch, or a size that depends
        on the data); a dim static inference got wrong is opened; a tensor it could not
        type at all gets the dtype and rank of the run.
        """
        info = self.ga.tensors[name]
        vi = self.ga.declared.get(name)
        if not info.dense:  # a sequence or a map: the model's own type, else the run's
            if vi is not None and vi.type.WhichOneof("value") not in (None, "tensor_type"):
                return vi
            out = onnx.ValueInfoProto(name=name)
            out.type.CopyFrom(type_from_ort(info.dtype))
            return out
        if vi is not None and vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            tt = vi.type.tensor_type
            if tt.HasField("shape") and len(tt.shape.dim) == len(info.shape):
                out = onnx.ValueInfoProto()
                out.CopyFrom(vi)
                for d, v in zip(out.type.tensor_type.shape.dim, info.shape):
                    if d.HasField("dim_value") and d.dim_value not in (v, -1):
                        d.Clear()
                return out
            elem = tt.elem_type
        else:
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
        # The checker wants a shape on graph inputs/outputs: the run's rank, dims open.
        return onnx.helper.make_tensor_value_info(name, elem, [None] * len(info.shape))

    def _add_weights(self, graph: onnx.GraphProto, names: Iterable[str]) -> None:
        """Append initializers, reading weights kept in side files straight into the graph.

        One copy of each external weight is made, in place: a partition's memory is
        its own weights (plus one serialised copy), never the whole model's.
        """
        for name in sorted(names, key=self._order.__getitem__):
            src = self._inits[name]
            t = graph.initializer.add()
            t.CopyFrom(src)  # for an external weight: only its name, type and file offset
            if not uses_external_data(src):
                continue
            files = self.ga.side_files
            if not self.ga.external_dir or files is None:  # bytes or a proto: nobody's files
                raise ModelError(inline_only(self.ga.name or "model", name))
            files.load(t, location_of(src), self.ga.name)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]

    def _extract(self, start: int, end: int, ins: Sequence[str],
                 outs: Sequence[str]) -> onnx.ModelProto:
        """The nodes of ``[start, end)`` (and copies of the constants they read) as a model."""
        ga = self.ga
        provided = set(ins)
        pending = {t for t in outs if t not in provided}
        keep: list[int] = []
        inits: set[str] = set()
        for j in range(end - 1, -1, -1):
            if not pending:
                break
            node = ga.nodes[j]
            made = [o for o in node.output if o in pending]
            if not made:
                continue
            if j < start and any(o not in ga.static for o in made):
                raise ModelError(f"cannot extract nodes [{start}, {end}): tensor '{made[0]}' "
                                 f"comes from node {j}, and no cut carries it")
            keep.append(j)
            pending.difference_update(node.output)
            for name in ga.node_inputs[j]:
                if name in provided:
                    continue
                if name in self._inits:
                    inits.add(name)
                else:
                    pending.add(name)
        if pending:
            raise ModelError(f"cannot extract nodes [{start}, {end}): nothing in it produces "
                             f"{', '.join(sorted(pending))}")
        keep.reverse()
        nodes = [ga.nodes[j] for j in keep]
        # No value_info for inner tensors: onnxruntime infers them, and a static guess
        # that disagrees with the run would only make it reject the partition.
        graph = onnx.helper.make_graph(
            nodes, ga.name, [self._io_info(t) for t in ins], [self._io_info(t) for t in outs])
        functions: list[onnx.FunctionProto] = []
        if self._functions:
            seen: set[tuple[str, str]] = set()
            queue = list(nodes)
            while queue:
                node = queue.pop()
                key = (node.op_type, node.domain)
                fn = self._functions.get(key)
                if fn is not None and key not in seen:
                    seen.add(key)
                    functions.append(fn)
                    queue.extend(fn.node)
        src = ga.model
        model = onnx.helper.make_model(graph, ir_version=src.ir_version,
                                       opset_imports=list(src.opset_import),
                                       producer_name="fogline", functions=functions)
        size = sum(ga.tensors[t].nbytes for t in inits if t in ga.tensors)
        if size >= _PROTO_LIMIT:  # checked before reading a byte of them
            raise ModelError(
                f"{ga.name}: partition of nodes [{start}, {end}) holds {size / 2**30:.2f} GiB "
                f"of weights, over the 2 GiB an ONNX file can hold; split into more "
                f"partitions")
        self._add_weights(model.graph, inits)  # after make_model, which copies the graph
        return model

    def extract(self, index: int, start: int, end: int, *,
                segments: tuple[int, int] | None = None,
                signer: KeyPair | None = None) -> PartitionArtifact:
        """The partition running nodes ``[start, end)``; its I/O are the cuts around it."""
        ga, n = self.ga, len(self.ga.nodes)
        if not 0 <= start < end <= n:
            raise ModelError(f"node range [{start}, {end}) is invalid for a {n}-node model")
        ins, outs = list(self._names[start]), list(self._names[end])
        part = self._extract(start, end, ins, outs)
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
            from runtime.verify import sign_artifact

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

    def iter_split(self, cuts: Sequence[int | Cut | Iterable[str]], *,
                   signer: KeyPair | None = None) -> Iterator[PartitionArtifact]:
        """Partitions between consecutive cuts, one at a time: a caller that writes each and
        drops it holds one partition's weights at once (the point for a large model)."""
        points = [c.index for c in resolve_cuts(self.ga, cuts)]
        bounds = [0, *points, len(self.ga.nodes)]
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            yield self.extract(i, a, b, signer=signer)

    def split(self, cuts: Sequence[int | Cut | Iterable[str]], *,
              signer: KeyPair | None = None) -> list[PartitionArtifact]:
        return list(self.iter_split(cuts, signer=signer))

    def cuts_into(self, k: int, *, strategy: Literal["cheapest", "balanced"] = "balanced"
                  ) -> list[Cut]:
        """The ``k - 1`` cuts of ``split_into(k)``, or a one-line ModelError."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ModelError(f"the number of partitions must be a positive integer, got {k!r}")
        most = max_partitions(self.ga)
        if k > most:
            raise ModelError(
                f"{self.ga.name}: cannot split into {k} partitions: it has {most - 1} cut "
                f"point(s) between nodes that do work, so at most {most} partition(s)"
            )
        cuts = list(chain_profile(self.ga, k, strategy=strategy).cuts)
        assert len(cuts) == k - 1
        return cuts

    def split_into(self, k: int, *, strategy: Literal["cheapest", "balanced"] = "balanced",
                   signer: KeyPair | None = None) -> list[PartitionArtifact]:
        """Exactly ``k`` partitions at the chain profile's cuts, or a one-line ModelError."""
        return self.split(self.cuts_into(k, strategy=strategy), signer=signer)


def split_into(src: ModelSource, k: int, *, strategy: Literal["cheapest", "balanced"] = "balanced",
               signer: KeyPair | None = None) -> list[PartitionArtifact]:
    """Exactly ``k`` partitions (cuts as the scheduler's chain profile would keep them)."""
    return Partitioner(src).split_into(k, strategy=strategy, signer=signer)


def split(src: ModelSource, cuts: Sequence[int | Cut | Iterable[str]], *,
          signer: KeyPair | None = None) -> list[PartitionArtifact]:
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
                      signer: KeyPair | None = None) -> list[PartitionArtifact]:
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

"""Measured segment times: run each segment of a model's chain in onnxruntime and time it.

The measured half of the cost model. ``time_segments(model, cuts)`` extracts every
segment between consecutive cuts exactly as ``models.partition`` ships it, opens
one onnxruntime session per segment with the given execution providers, feeds
each segment the tensors the previous ones produced (one chained run on seeded
inputs), then times every segment ``repeats`` times back to back (warm, as a
device runs the one partition it hosts) and keeps the median. The whole model and
the chain end to end are timed the same way, so a caller can see the cost of cutting.

It is the step an edge agent runs once per model and device class to calibrate
the scheduler (``SegmentTimes.seconds`` becomes a chain profile's
``segment_times_s[device class]``), and what ``fogline models bench-segments``
prints. The clock is a parameter; nothing here reads configuration or the network.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models.cuts import DEFAULT_SEGMENTS, ChainProfile, Cut, chain_profile
from models.errors import ModelError
from models.graph import GraphAnalysis, ModelSource
from models.partition import Partitioner
from models.probe import analyze

__all__ = ["SegmentTimes", "time_segments", "DEFAULT_PROVIDERS"]

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)


@dataclass(frozen=True, slots=True)
class SegmentTimes:
    """Median wall time of each segment (seconds), of the whole model, and of the chain."""

    model: str
    segments: tuple[tuple[int, int], ...]  # node ranges [start, end) in topological order
    seconds: tuple[float, ...]  # median per segment, same order
    whole_s: float  # the unsplit model in one session
    chain_s: float  # the segments run one after another, as a chain of sessions
    providers: tuple[str, ...]  # what onnxruntime actually used
    threads: int
    repeats: int
    flops: tuple[int, ...] = ()  # per segment, from the profile

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    @property
    def calibrated(self) -> tuple[float, ...]:
        """Segment times scaled to sum to the whole model's time: what the scheduler adds up.

        Timed alone, each segment pays a session call and cold caches; its share of the
        summed times, applied to the unsplit run, predicts a partition of several
        segments better than the raw sum does.
        """
        total = self.total_s
        if total <= 0:
            return self.seconds
        return tuple(t * self.whole_s / total for t in self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "segments": [list(s) for s in self.segments],
            "seconds": list(self.seconds),
            "calibrated_s": list(self.calibrated),
            "flops": list(self.flops),
            "whole_s": self.whole_s,
            "chain_s": self.chain_s,
            "providers": list(self.providers),
            "threads": self.threads,
            "repeats": self.repeats,
        }


def _session(data: bytes, providers: Sequence[str], threads: int,
             external_dir: str = "") -> Any:
    import onnxruntime as ort

    from models.probe import session_options

    try:
        return ort.InferenceSession(data, session_options(threads=threads,
                                                          external_dir=external_dir or None,
                                                          from_bytes=True),
                                    providers=list(providers))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own classes
        text = str(exc).strip().splitlines()
        raise ModelError(f"onnxruntime cannot load the model with providers "
                         f"{','.join(providers)}: "
                         f"{text[0] if text else type(exc).__name__}") from None


def _runner(sess: Any) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    names = [o.name for o in sess.get_outputs()]
    ins = [i.name for i in sess.get_inputs()]

    def run(env: Mapping[str, Any]) -> dict[str, Any]:
        return dict(zip(names, sess.run(names, {n: env[n] for n in ins})))
    return run


def _bounds(ga: GraphAnalysis, cuts: Sequence[int | Cut | Iterable[str]] | ChainProfile | None
            ) -> tuple[list[int], tuple[int, ...]]:
    """Node positions of the cuts, and each segment's FLOPs."""
    if isinstance(cuts, ChainProfile):
        if not cuts.segments or cuts.segments[-1].end != len(ga.nodes):
            raise ModelError(f"chain profile of '{cuts.model}' does not match this model")
        cp = cuts
    elif cuts is None:
        cp = chain_profile(ga, DEFAULT_SEGMENTS, strategy="balanced")
    else:
        cp = chain_profile(ga, cuts=cuts)
    return [s.start for s in cp.segments[1:]], tuple(s.flops for s in cp.segments)


def time_segments(src: ModelSource, cuts: Sequence[int | Cut | Iterable[str]] | ChainProfile |
                  None = None, *, dims: Mapping[str, int] | None = None,
                  input_shapes: Mapping[str, Sequence[int]] | None = None,
                  input_values: Mapping[str, object] | None = None,
                  providers: Sequence[str] = DEFAULT_PROVIDERS, threads: int = 1,
                  repeats: int = 20, warmup: int = 2, seed: int = 3,
                  clock: Callable[[], float] = time.perf_counter) -> SegmentTimes:
    """Time each segment between ``cuts`` (node positions, Cuts, or a ChainProfile).

    Without ``cuts`` the segments are those of the chain profile the fog broker
    places (16 balanced segments). ``providers`` are onnxruntime execution providers
    in order of preference; ``threads`` the intra-op threads of every session.
    Raises ModelError for a model, cut list or provider onnxruntime cannot run.
    """
    if repeats < 1 or warmup < 0 or threads < 1:
        raise ModelError("repeats and threads must be >= 1 and warmup >= 0")
    import onnxruntime as ort

    have = ort.get_available_providers()
    missing = [p for p in providers if p not in have]
    if missing or not providers:
        # onnxruntime would quietly fall back to the CPU: the times would lie.
        raise ModelError(f"execution provider {missing[0] if missing else '(none given)'} is "
                         f"not available here (onnxruntime has {', '.join(have)})")
    ga = analyze(src, dims=dims, input_shapes=input_shapes, input_values=input_values)
    points, flops = _bounds(ga, cuts)
    partitioner = Partitioner(ga)
    parts = partitioner.split(points)
    from models.probe import feeds_for

    feeds = feeds_for(ga, input_values, seed=seed)
    sessions = [_session(p.onnx_bytes, providers, threads) for p in parts]
    runs = [_runner(sess) for sess in sessions]
    # The whole model as one partition: the declared input types of the exported model.
    whole_part = partitioner.extract(0, 0, len(ga.nodes))
    whole = _runner(_session(whole_part.onnx_bytes, providers, threads))
    used = tuple(sessions[0].get_providers())
    env: dict[str, Any] = dict(feeds)
    seg_in: list[dict[str, Any]] = []
    for run in runs:  # one chained run gives every segment real inputs
        seg_in.append(dict(env))
        env.update(run(env))

    def chain(_: Mapping[str, Any]) -> None:
        e: dict[str, Any] = dict(feeds)
        for r in runs:
            e.update(r(e))

    def timed(run: Callable[[Mapping[str, Any]], Any], given: Mapping[str, Any]) -> float:
        # Back to back, warm: as a device runs the one partition it hosts.
        for _ in range(warmup):
            run(given)
        samples = []
        for _ in range(repeats):
            t0 = clock()
            run(given)
            samples.append(clock() - t0)
        return statistics.median(samples)

    seconds = tuple(timed(run, seg_in[i]) for i, run in enumerate(runs))
    whole_s = timed(whole, feeds)
    chain_s = timed(chain, feeds)
    return SegmentTimes(
        model=ga.name,
        segments=tuple(p.nodes for p in parts),
        seconds=seconds,
        whole_s=whole_s,
        chain_s=chain_s,
        providers=used,
        threads=threads,
        repeats=repeats,
        flops=flops,
    )

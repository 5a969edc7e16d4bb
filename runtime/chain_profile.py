"""The segment record of COST_MODEL.md's chain profile, in one place for both of its writers.

``models.cuts`` measures a model and writes its chain profile; the fog's placement core
(``fog_broker.placement.model``) stores and re-reads it. Neither may import the other (the
placement core is pure, ``models.cuts`` runs onnx), so the record's keys live here, below both.
"""
from __future__ import annotations

from typing import Any

__all__ = ["SEGMENT_KEYS", "segment_dict"]

#: A segment's keys on the wire, in COST_MODEL.md's order (units there).
SEGMENT_KEYS = ("name", "flops", "param_bytes", "activation_bytes", "out_bytes")


def segment_dict(segment: object) -> dict[str, Any]:
    """``segment``'s chain-profile entry: exactly ``SEGMENT_KEYS`` (a node range, say, stays out)."""
    return {key: getattr(segment, key) for key in SEGMENT_KEYS}

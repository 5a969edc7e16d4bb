"""Flower replies in the strategy's terms: an error reply as one rejection line, clients' metrics as their
medians (one liar cannot drag a loss to -1e9), a reason as a metric name."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from .layout import CLIENT_ERROR, MAX_EXAMPLES

__all__ = ["ReplyConfig", "flower_error", "median_metrics", "reason_slug"]


def reason_slug(reason: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in reason.lower()).strip("-")


_ERROR_NAMES = {v: k for k, v in vars(ErrorCode).items() if k.isupper() and isinstance(v, int)}


def flower_error(msg: Message) -> str:
    """A rejection for an error reply: Flower's code, its name, who generated it and the reason (one line)."""
    err = msg.error
    code = int(getattr(err, "code", 0) or 0)
    by = ", from the SuperLink" if int(msg.metadata.src_node_id) == SUPERLINK_NODE_ID else ""
    reason = " ".join(str(getattr(err, "reason", "") or "").split())[:160]
    name = f" {_ERROR_NAMES[code]}" if code in _ERROR_NAMES else ""  # 3001: an app's own code (site bridge)
    return f"{CLIENT_ERROR} (flower {code}{name}{by}: {reason})"


def median_metrics(contents: Sequence[RecordDict], skip: str) -> dict[str, float]:
    """Per key, the median of the clients' scalar metrics: one liar cannot drag a loss to -1e9."""
    values: dict[str, list[float]] = {}
    for c in contents:
        for rec in c.metric_records.values():
            for k, v in rec.items():
                if k != skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    values.setdefault(k, []).append(float(v))
    return {k: float(np.median(v)) for k, v in sorted(values.items())}


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    """Where a reply's parts are and how far its example count is believed (``RobustStrategy``).

    The keys are Flower's ``FedAvg`` ones; ``max_examples`` bounds a claimed example count so one
    client cannot outweigh the rest under ``mean``.
    """

    weighted_by_key: str = "num-examples"
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    max_examples: int = MAX_EXAMPLES

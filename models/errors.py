"""Errors of the models package: bad ONNX input is the caller's (or a peer's) fault."""
from __future__ import annotations

from runtime.errors import FoglineError

__all__ = ["ModelError", "ProfileWarning"]


class ModelError(FoglineError, ValueError):
    """A model, cut list or shape we cannot work with; the message names the problem."""


class ProfileWarning(UserWarning):
    """An op the profiler does not know; it is counted as zero FLOPs."""

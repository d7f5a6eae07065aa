"""The context stage's error hierarchy.

The pure parts of the stage (budget, packer, formatter) raise these for caller bugs; the stage's service lets them
propagate, and only the gRPC edge maps them to status codes. Plain ``ValueError`` subclasses, so a caller that
only knows "bad input" can catch them as such.
"""

from __future__ import annotations

__all__ = ["MixedEstimateError"]


class MixedEstimateError(ValueError):
    """Token estimates of different kinds or tokenizer families were combined.

    Two upper bounds made different ways (or for different tokenizers) do not add up to an upper bound of
    anything, so combining them is refused rather than averaged.
    """

"""An organization's model policy: glob patterns of models it allows and denies (``spec.models``).

One rule for every caller that picks a model for a tenant: the proxy's model gate and the memory stage's fact
extraction. A denied pattern wins; an empty allow list allows every model that is not denied.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase


def model_allowed(model: str, allow: Iterable[str], deny: Iterable[str]) -> bool:
    if any(fnmatchcase(model, pattern) for pattern in deny):
        return False
    allowed = list(allow)
    return not allowed or any(fnmatchcase(model, pattern) for pattern in allowed)

"""Errors raised by the PII stage.

Owns the exception types of ``ibex_dataplane.pii``. The memory write path treats any ``PiiError`` from
``redact`` as "this content could not be checked" and fails the write (nothing unchecked is stored); a
``PiiConfigurationError`` surfaces at start-up, where the redactor is built. Messages never contain the
analysed text or anything matched in it.
"""

from __future__ import annotations


class PiiError(Exception):
    """Detecting or redacting PII failed; the cause, if any, is chained as ``__cause__``."""


class PiiConfigurationError(PiiError):
    """The redactor cannot be built as asked (an unknown entity type, a missing optional NER model)."""

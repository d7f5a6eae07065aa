"""PII detection and redaction for the memory write path (architecture section 9.2, stage 2).

``redactor`` holds ``PiiRedactor`` and its result types; importing this package does not load Presidio,
import ``ibex_dataplane.pii.redactor`` for that.
"""

from ibex_dataplane.pii.errors import PiiConfigurationError, PiiError

__all__ = ["PiiConfigurationError", "PiiError"]

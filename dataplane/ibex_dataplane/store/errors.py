"""Errors of the store layer. Callers map them to HTTP codes at the edge (for example StoreUnavailable -> 503)."""


class StoreError(Exception):
    """Base class for store-layer errors."""


class StoreUnavailable(StoreError):
    """A backing store (Postgres, Redis, ClickHouse) could not be reached or timed out."""

    def __init__(self, store: str, detail: str) -> None:
        super().__init__(f"{store} unavailable: {detail}")
        self.store = store


class StoreQueryError(StoreError):
    """The store answered, but refused the statement (SQL or type error): a bug on our side, not an outage.

    The message names the store and the error class only; the driver's text stays in the server log."""

    def __init__(self, store: str, kind: str) -> None:
        super().__init__(f"{store} rejected a statement ({kind})")
        self.store = store


class MigrationError(StoreError):
    """A migration could not be applied, an applied migration was changed after the fact, or the schema a process
    waits for (``ibex wait-schema``) did not arrive in time."""


class TenantKeyError(StoreError, ValueError):
    """A tenant key or query was requested without a valid organization."""

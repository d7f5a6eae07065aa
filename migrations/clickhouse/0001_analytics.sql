-- 0001: analytics tables. ClickHouse has no row-level security: every query is built by one function that
-- requires org_id (ibex_dataplane.store.clickhouse), and org_id leads every sorting key.

-- One row per proxied request: ids, model, tokens, latencies, outcome. Never message content.
CREATE TABLE IF NOT EXISTS llm_traces
(
    org_id              UUID,
    agent_id            UUID,
    request_id          String,
    ts                  DateTime64(3, 'UTC'),
    key_id              String,
    session_id          String,
    route               LowCardinality(String),
    model               LowCardinality(String),
    provider            LowCardinality(String),
    stream              UInt8,
    status_code         UInt16,
    error_code          LowCardinality(String),
    prompt_tokens       UInt32,
    completion_tokens   UInt32,
    cost_usd            Decimal(18, 8),
    latency_ms          Float64,
    upstream_ms         Float64,
    stage_ms            Map(LowCardinality(String), Float64),
    memories_injected   UInt16,
    context_tokens      UInt32,
    context_degraded    UInt8,
    degradations        Array(LowCardinality(String))
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (org_id, ts, request_id);

-- Spend and tokens per request, idempotent by request id (a replayed insert collapses on merge; read with FINAL).
CREATE TABLE IF NOT EXISTS usage_facts
(
    org_id              UUID,
    agent_id            UUID,
    request_id          String,
    ts                  DateTime64(3, 'UTC'),
    model               LowCardinality(String),
    prompt_tokens       UInt32,
    completion_tokens   UInt32,
    cost_usd            Decimal(18, 8),
    inserted_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(inserted_at)
PARTITION BY toYYYYMM(ts)
ORDER BY (org_id, request_id);

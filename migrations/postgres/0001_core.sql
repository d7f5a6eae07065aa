-- 0001: the core schema. Forward-only: never edit an applied migration, add a new one.
--
-- Tenancy: every tenant row carries org_id, every agent-scoped row also agent_id. Row-level security is ENABLE +
-- FORCE on every tenant table with policies on current_setting('app.org_id'); the data plane connects as a member
-- of ibex_app (NOSUPERUSER NOBYPASSRLS) and sets app.org_id per transaction. No org set means zero rows.
-- Migrations run as the privileged owner role, which must be a superuser or have BYPASSRLS (it also owns the
-- SECURITY DEFINER key lookup below).

CREATE EXTENSION IF NOT EXISTS vector;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ibex_app') THEN
        CREATE ROLE ibex_app NOLOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
    END IF;
END
$$;

-- The tenant the current transaction acts for; NULL when unset (and '' after a reset counts as unset).
CREATE FUNCTION ibex_current_org() RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT nullif(current_setting('app.org_id', true), '')::uuid $$;

CREATE FUNCTION ibex_current_agent() RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT nullif(current_setting('app.agent_id', true), '')::uuid $$;

CREATE FUNCTION ibex_forbid_update() RETURNS trigger
    LANGUAGE plpgsql
    AS $$ BEGIN RAISE EXCEPTION '% rows are immutable', TG_TABLE_NAME USING ERRCODE = 'integrity_constraint_violation'; END $$;

-- ---------------------------------------------------------------------------------------------------------------
-- Tenants, written by the operator (or the local manifest loader) through the reconcile code.
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE organizations (
    id                  uuid PRIMARY KEY,
    namespace           text NOT NULL,
    name                text NOT NULL,
    display_name        text NOT NULL DEFAULT '',
    suspended           boolean NOT NULL DEFAULT false,
    rpm_limit           integer CHECK (rpm_limit > 0),
    tpm_limit           integer CHECK (tpm_limit > 0),
    budget_limit_usd    numeric(18, 8) CHECK (budget_limit_usd >= 0),
    budget_enforcement  text NOT NULL DEFAULT 'HardCap' CHECK (budget_enforcement IN ('HardCap', 'AlertOnly')),
    models_allow        text[] NOT NULL DEFAULT '{}',
    models_deny         text[] NOT NULL DEFAULT '{}',
    default_model       text,
    generation          bigint NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (namespace, name)
);

CREATE TABLE agents (
    id                      uuid PRIMARY KEY,
    org_id                  uuid NOT NULL REFERENCES organizations (id) ON DELETE CASCADE,
    namespace               text NOT NULL,
    name                    text NOT NULL,
    display_name            text NOT NULL DEFAULT '',
    suspended               boolean NOT NULL DEFAULT false,
    default_model           text,
    rpm_limit               integer CHECK (rpm_limit > 0),
    tpm_limit               integer CHECK (tpm_limit > 0),
    budget_limit_usd        numeric(18, 8) CHECK (budget_limit_usd >= 0),
    memory_enabled          boolean NOT NULL DEFAULT true,
    memory_context_tokens   integer NOT NULL DEFAULT 2000 CHECK (memory_context_tokens >= 0),
    generation              bigint NOT NULL DEFAULT 0,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    UNIQUE (namespace, name),
    UNIQUE (org_id, name),
    UNIQUE (org_id, id)          -- target of composite foreign keys: an agent-scoped row's org must be its agent's
);

CREATE TABLE api_keys (
    id              text PRIMARY KEY,                 -- the public key id inside ibex_sk_<id>_<secret>
    org_id          uuid NOT NULL REFERENCES organizations (id) ON DELETE CASCADE,
    namespace       text NOT NULL,
    name            text NOT NULL,
    secret_hash     bytea NOT NULL,                   -- HMAC-SHA256(pepper, secret); never the secret
    scopes          text[] NOT NULL,
    expires_at      timestamptz,
    revoked_at      timestamptz,
    rotation        integer NOT NULL DEFAULT 0,       -- spec.rotation last applied (bump it to rotate)
    rotated_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (namespace, name)
);

CREATE TABLE api_key_agents (
    key_id      text NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    org_id      uuid NOT NULL,
    agent_id    uuid NOT NULL,
    PRIMARY KEY (key_id, agent_id),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);

CREATE TABLE directives (
    id              uuid PRIMARY KEY,
    org_id          uuid NOT NULL,
    agent_id        uuid NOT NULL,
    namespace       text NOT NULL,
    name            text NOT NULL,
    active_version  integer NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (namespace, name),
    UNIQUE (agent_id),                               -- one directive per agent
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);

CREATE TABLE directive_versions (
    directive_id    uuid NOT NULL REFERENCES directives (id) ON DELETE CASCADE,
    version         integer NOT NULL CHECK (version > 0),
    org_id          uuid NOT NULL,
    agent_id        uuid NOT NULL,
    content         text NOT NULL,
    content_sha256  text NOT NULL,
    injection_mode  text NOT NULL CHECK (injection_mode IN ('SystemFirst', 'SystemAppend', 'UserPrepend')),
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (directive_id, version),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);
CREATE TRIGGER directive_versions_immutable BEFORE UPDATE ON directive_versions
    FOR EACH ROW EXECUTE FUNCTION ibex_forbid_update();

-- ---------------------------------------------------------------------------------------------------------------
-- Sessions: checkpoints keep hashes and counts, never message text.
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE sessions (
    id                  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id              uuid NOT NULL,
    agent_id            uuid NOT NULL,
    external_id         text NOT NULL,               -- the client's X-IBEX-Session-ID
    status              text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'closed')),
    turn_count          integer NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    last_activity_at    timestamptz NOT NULL DEFAULT now(),
    closed_at           timestamptz,
    close_reason        text,
    UNIQUE (org_id, agent_id, external_id),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);
CREATE INDEX sessions_idle ON sessions (last_activity_at) WHERE status = 'active';

CREATE TABLE session_checkpoints (
    session_id          uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn                integer NOT NULL,
    org_id              uuid NOT NULL,
    agent_id            uuid NOT NULL,
    request_id          text NOT NULL,
    messages_sha256     text[] NOT NULL,
    completion_sha256   text,
    prompt_tokens       integer NOT NULL DEFAULT 0,
    completion_tokens   integer NOT NULL DEFAULT 0,
    latency_ms          real NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, turn)
);

-- ---------------------------------------------------------------------------------------------------------------
-- Memories.
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE memories (
    id                  uuid PRIMARY KEY,
    org_id              uuid NOT NULL,
    agent_id            uuid NOT NULL,
    content             text CHECK (content IS NULL OR octet_length(content) BETWEEN 1 AND 10000),
    content_hash        bytea NOT NULL,               -- SHA-256 of normalized content; keyed digest once forgotten
    status              text NOT NULL CHECK (status IN ('active', 'superseded', 'quarantined', 'forgotten')),
    source              text NOT NULL CHECK (source IN ('user_provided', 'extracted', 'imported')),
    session_id          text,
    request_id          text,
    observed_at         timestamptz,
    valid_from          timestamptz,
    valid_until         timestamptz,
    confidence          real NOT NULL DEFAULT 1.0 CHECK (confidence BETWEEN 0 AND 1),
    usefulness          real NOT NULL DEFAULT 0.5 CHECK (usefulness BETWEEN 0 AND 1),
    positive_feedback   integer NOT NULL DEFAULT 0,
    negative_feedback   integer NOT NULL DEFAULT 0,
    retrieval_count     integer NOT NULL DEFAULT 0,
    last_retrieved_at   timestamptz,
    metadata            jsonb NOT NULL DEFAULT '{}'::jsonb,
    embedding           vector(384),
    content_tsv         tsvector GENERATED ALWAYS AS (to_tsvector('english', coalesce(content, ''))) STORED,
    revision            bigint NOT NULL DEFAULT 1,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    forgotten_at        timestamptz,
    CHECK (valid_until IS NULL OR valid_from IS NULL OR valid_until > valid_from),
    CHECK (status <> 'forgotten' OR (content IS NULL AND embedding IS NULL)),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);
-- The exact-dedup invariant under concurrency: one active row per (org, agent, normalized content).
CREATE UNIQUE INDEX memories_active_content ON memories (org_id, agent_id, content_hash) WHERE status = 'active';
CREATE INDEX memories_embedding_hnsw ON memories USING hnsw (embedding vector_cosine_ops)
    WHERE status = 'active' AND embedding IS NOT NULL;
CREATE INDEX memories_content_tsv ON memories USING gin (content_tsv);
CREATE INDEX memories_by_agent ON memories (org_id, agent_id, created_at DESC, id);

CREATE TABLE memory_labels (
    memory_id   uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    label       text NOT NULL,
    org_id      uuid NOT NULL,
    agent_id    uuid NOT NULL,
    PRIMARY KEY (memory_id, label)
);
CREATE INDEX memory_labels_by_label ON memory_labels (org_id, agent_id, label);

CREATE TABLE memory_relationships (
    source_id       uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    target_id       uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    kind            text NOT NULL CHECK (kind IN ('supersedes', 'contradicts', 'overlaps', 'specializes',
                                                  'near_duplicate_of')),
    org_id          uuid NOT NULL,
    agent_id        uuid NOT NULL,
    score           real,
    needs_review    boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_id, target_id, kind),
    CHECK (source_id <> target_id)
);
CREATE INDEX memory_relationships_target ON memory_relationships (target_id);

-- ---------------------------------------------------------------------------------------------------------------
-- Idempotency ledger, scoped by (org, agent, key).
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE idempotency_keys (
    org_id              uuid NOT NULL,
    agent_id            uuid NOT NULL,
    key                 text NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    route               text NOT NULL,
    request_hash        bytea NOT NULL,
    state               text NOT NULL CHECK (state IN ('in_progress', 'completed')),
    response_status     integer,
    response_headers    jsonb,
    response_body       bytea,
    locked_until        timestamptz NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    completed_at        timestamptz,
    expires_at          timestamptz NOT NULL,
    PRIMARY KEY (org_id, agent_id, key),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);

-- ---------------------------------------------------------------------------------------------------------------
-- Budgets: reserve (hold) before the provider call, settle after. Per scope (the org, or one agent) per month.
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE budget_periods (
    org_id          uuid NOT NULL,
    scope_kind      text NOT NULL CHECK (scope_kind IN ('org', 'agent')),
    scope_id        uuid NOT NULL,                   -- the org id or the agent id
    period_start    date NOT NULL,
    limit_usd       numeric(18, 8),                  -- NULL: no limit
    enforcement     text NOT NULL CHECK (enforcement IN ('HardCap', 'AlertOnly')),
    spent_usd       numeric(18, 8) NOT NULL DEFAULT 0 CHECK (spent_usd >= 0),
    held_usd        numeric(18, 8) NOT NULL DEFAULT 0 CHECK (held_usd >= 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, scope_id, period_start)
);

CREATE TABLE budget_holds (
    id              uuid PRIMARY KEY,
    org_id          uuid NOT NULL,
    agent_id        uuid NOT NULL,
    request_id      text NOT NULL,
    period_start    date NOT NULL,
    amount_usd      numeric(18, 8) NOT NULL CHECK (amount_usd >= 0),
    actual_usd      numeric(18, 8),
    status          text NOT NULL CHECK (status IN ('held', 'settled', 'released', 'expired')),
    expires_at      timestamptz NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    settled_at      timestamptz,
    UNIQUE (org_id, request_id),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE
);
CREATE INDEX budget_holds_open ON budget_holds (expires_at) WHERE status = 'held';

CREATE TABLE budget_ledger (
    id                  bigserial PRIMARY KEY,
    org_id              uuid NOT NULL,
    agent_id            uuid NOT NULL,
    request_id          text NOT NULL,
    model               text NOT NULL,
    prompt_tokens       integer NOT NULL DEFAULT 0,
    completion_tokens   integer NOT NULL DEFAULT 0,
    cost_usd            numeric(18, 8) NOT NULL CHECK (cost_usd >= 0),
    created_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, request_id)                      -- the ledger is idempotent by request id
);
CREATE INDEX budget_ledger_by_agent ON budget_ledger (org_id, agent_id, created_at);

-- ---------------------------------------------------------------------------------------------------------------
-- Outbox: after-commit effects (hot cache, indexes) recorded in the same transaction as the change, then retried.
-- ---------------------------------------------------------------------------------------------------------------

CREATE TABLE outbox (
    id              bigserial PRIMARY KEY,
    org_id          uuid NOT NULL,
    agent_id        uuid,
    kind            text NOT NULL,
    payload         jsonb NOT NULL DEFAULT '{}'::jsonb,
    attempts        integer NOT NULL DEFAULT 0,
    last_error      text,
    available_at    timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now(),
    done_at         timestamptz
);
CREATE INDEX outbox_pending ON outbox (available_at, id) WHERE done_at IS NULL;

-- ---------------------------------------------------------------------------------------------------------------
-- Row-level security on every tenant table.
-- ---------------------------------------------------------------------------------------------------------------

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['agents', 'api_keys', 'api_key_agents', 'directives', 'directive_versions',
                             'sessions', 'session_checkpoints', 'memories', 'memory_labels',
                             'memory_relationships', 'idempotency_keys', 'budget_periods', 'budget_holds',
                             'budget_ledger', 'outbox']
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY tenant_isolation ON %I USING (org_id = ibex_current_org()) '
                       'WITH CHECK (org_id = ibex_current_org())', t);
    END LOOP;
    -- Agent-scoped tables: when a transaction also names its agent, it sees only that agent's rows.
    FOREACH t IN ARRAY ARRAY['memories', 'memory_labels', 'memory_relationships', 'sessions',
                             'session_checkpoints', 'idempotency_keys']
    LOOP
        EXECUTE format('CREATE POLICY agent_isolation ON %I AS RESTRICTIVE '
                       'USING (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent()) '
                       'WITH CHECK (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent())', t);
    END LOOP;
END
$$;

ALTER TABLE organizations ENABLE ROW LEVEL SECURITY;
ALTER TABLE organizations FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON organizations USING (id = ibex_current_org()) WITH CHECK (id = ibex_current_org());

-- ---------------------------------------------------------------------------------------------------------------
-- Key lookup before the tenant is known: the only cross-tenant read the data plane may do, by public key id.
-- ---------------------------------------------------------------------------------------------------------------

CREATE FUNCTION ibex_lookup_api_key(p_key_id text)
    RETURNS TABLE (key_id text, org_id uuid, secret_hash bytea, scopes text[], expires_at timestamptz,
                   revoked_at timestamptz, agent_ids uuid[])
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT k.id, k.org_id, k.secret_hash, k.scopes, k.expires_at, k.revoked_at,
               coalesce(array_agg(a.agent_id ORDER BY a.agent_id) FILTER (WHERE a.agent_id IS NOT NULL), '{}')
          FROM api_keys k
          LEFT JOIN api_key_agents a ON a.key_id = k.id
         WHERE k.id = p_key_id
         GROUP BY k.id
    $$;
REVOKE ALL ON FUNCTION ibex_lookup_api_key(text) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Privileges of the data plane. Tenant configuration is read-only to it: only the operator writes it.
-- ---------------------------------------------------------------------------------------------------------------

GRANT USAGE ON SCHEMA public TO ibex_app;
GRANT EXECUTE ON FUNCTION ibex_lookup_api_key(text), ibex_current_org(), ibex_current_agent() TO ibex_app;
GRANT SELECT ON organizations, agents, api_keys, api_key_agents, directives, directive_versions TO ibex_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON sessions, session_checkpoints, memories, memory_labels,
    memory_relationships, idempotency_keys, budget_holds, outbox TO ibex_app;
GRANT SELECT, INSERT, UPDATE ON budget_periods TO ibex_app;
GRANT SELECT, INSERT ON budget_ledger TO ibex_app;
GRANT USAGE, SELECT ON SEQUENCE budget_ledger_id_seq, outbox_id_seq TO ibex_app;

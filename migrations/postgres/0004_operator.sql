-- 0004: what the operator removed when an Organization or Agent was deleted (architecture section 4).
--
-- One row per deleted resource (by Kubernetes uid), written by the operator's finalizer before the resource goes:
-- counts per store and per table or key family, never content. Purging an organization removes every other row
-- that carries its org_id, but not these: they are the record that the data is gone. Operator-only: the data
-- plane's role has no grant, and row-level security is on with no policy for it.

CREATE TABLE tenant_deletions (
    id              bigserial PRIMARY KEY,
    resource_uid    text NOT NULL UNIQUE,            -- metadata.uid of the deleted custom resource
    kind            text NOT NULL CHECK (kind IN ('Organization', 'Agent')),
    namespace       text NOT NULL,
    name            text NOT NULL,
    org_id          uuid,                            -- NULL when the resource never reached the stores
    agent_id        uuid,
    removed         jsonb NOT NULL DEFAULT '{}'::jsonb,  -- {"postgres": {"memories": 3}, "redis": {...}, ...}
    attempts        integer NOT NULL DEFAULT 1,
    started_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz
);
CREATE INDEX tenant_deletions_by_org ON tenant_deletions (org_id);

ALTER TABLE tenant_deletions ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_deletions FORCE ROW LEVEL SECURITY;

-- 0030: memories from conversations (capture). Called by ibex_dataplane.proxy.sessions (enqueue, with the session
-- checkpoint) and ibex_dataplane.memory.capture (the workers).
--
-- 1. The agent's capture policy (spec.memory.capture, captureRoles, extractionModel), reconciled by the operator.
-- 2. capture_jobs: the durable queue. One row per captured chat turn, written in the same statement as the turn's
--    session checkpoint, so a turn that has a checkpoint has its job. The row holds message text only until it is
--    processed: a finished job is deleted; a job that failed for good keeps its metadata and error but loses its
--    text; and `expires_at` bounds how long any text is kept even when no worker runs (housekeeping deletes it).
-- 3. Workers find work across tenants through a SECURITY DEFINER lease that returns ids and owners only (as the
--    outbox lease does); they read a job's messages inside that org's own row-level-security scope.

ALTER TABLE agents
    ADD COLUMN memory_capture text NOT NULL DEFAULT 'off' CHECK (memory_capture IN ('off', 'turns', 'facts')),
    ADD COLUMN memory_capture_roles text[] NOT NULL DEFAULT ARRAY['user']::text[]
        CHECK (memory_capture_roles <@ ARRAY['user', 'assistant']::text[]),
    ADD COLUMN memory_extraction_model text;

CREATE TABLE capture_jobs (
    id              bigserial PRIMARY KEY,
    org_id          uuid NOT NULL,
    agent_id        uuid NOT NULL,
    session_id      text NOT NULL,
    turn            integer NOT NULL,
    request_id      text NOT NULL,
    mode            text NOT NULL CHECK (mode IN ('turns', 'facts')),
    model           text,                      -- the extraction model (facts)
    messages        jsonb,                     -- [{"role", "content"}]; NULL once the job has failed for good
    observed_at     timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now(),
    available_at    timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL DEFAULT now() + interval '7 days',
    attempts        integer NOT NULL DEFAULT 0,
    failed_at       timestamptz,
    last_error      text,
    UNIQUE (org_id, agent_id, session_id, turn),
    FOREIGN KEY (org_id, agent_id) REFERENCES agents (org_id, id) ON DELETE CASCADE,
    CHECK ((failed_at IS NULL) = (messages IS NOT NULL))
);
CREATE INDEX capture_jobs_due ON capture_jobs (available_at, id) WHERE failed_at IS NULL;

ALTER TABLE capture_jobs ENABLE ROW LEVEL SECURITY;
ALTER TABLE capture_jobs FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON capture_jobs USING (org_id = ibex_current_org())
    WITH CHECK (org_id = ibex_current_org());
CREATE POLICY agent_isolation ON capture_jobs AS RESTRICTIVE
    USING (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent())
    WITH CHECK (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent());
GRANT SELECT, INSERT, UPDATE, DELETE ON capture_jobs TO ibex_app;
GRANT USAGE, SELECT ON SEQUENCE capture_jobs_id_seq TO ibex_app;

-- A session turn and, when `p_capture` is not NULL, its capture job, in one statement (one transaction).
CREATE FUNCTION ibex_session_turn_capture_as(
    p_org uuid, p_agent uuid, p_external_id text, p_request_id text, p_messages text[], p_completion text,
    p_prompt_tokens integer, p_completion_tokens integer, p_latency_ms real, p_mode text, p_model text,
    p_capture jsonb, p_observed_at timestamptz, p_ttl interval) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_turn integer;
BEGIN
    v_turn := ibex_session_turn_as(p_org, p_agent, p_external_id, p_request_id, p_messages, p_completion,
                                   p_prompt_tokens, p_completion_tokens, p_latency_ms);
    IF p_capture IS NOT NULL THEN
        INSERT INTO capture_jobs (org_id, agent_id, session_id, turn, request_id, mode, model, messages,
                                  observed_at, expires_at)
        VALUES (p_org, p_agent, p_external_id, v_turn, p_request_id, p_mode, p_model, p_capture,
                coalesce(p_observed_at, now()), now() + p_ttl)
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN v_turn;
END
$$;

CREATE FUNCTION ibex_capture_lease_ids(p_limit integer, p_lease interval)
    RETURNS TABLE (id bigint, org_id uuid, agent_id uuid, attempts integer)
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH due AS (
            SELECT j.id
              FROM public.capture_jobs j
             WHERE j.failed_at IS NULL AND j.available_at <= now() AND j.expires_at > now()
             ORDER BY j.available_at, j.id
             LIMIT greatest(p_limit, 0)
               FOR UPDATE SKIP LOCKED
        )
        UPDATE public.capture_jobs j
           SET available_at = now() + p_lease, attempts = j.attempts + 1
          FROM due
         WHERE j.id = due.id
        RETURNING j.id, j.org_id, j.agent_id, j.attempts
    $$;

-- Expired text goes whatever the job's state; failed jobs (metadata only) go after p_failed_age.
CREATE FUNCTION ibex_capture_housekeeping(p_failed_age interval, p_limit integer)
    RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
DECLARE
    v_count integer;
BEGIN
    DELETE FROM public.capture_jobs j
     WHERE j.id IN (SELECT x.id FROM public.capture_jobs x
                     WHERE x.expires_at <= now() OR x.failed_at < now() - p_failed_age
                     LIMIT greatest(p_limit, 0));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Queue depth and the age of the oldest waiting job, across tenants (counts only), for the metrics.
CREATE FUNCTION ibex_capture_backlog(OUT waiting bigint, OUT failed bigint, OUT oldest_seconds double precision)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        SELECT count(*) FILTER (WHERE j.failed_at IS NULL),
               count(*) FILTER (WHERE j.failed_at IS NOT NULL),
               coalesce(extract(epoch FROM now() - min(j.created_at) FILTER (WHERE j.failed_at IS NULL)), 0)
          FROM public.capture_jobs j
    $$;

REVOKE ALL ON FUNCTION ibex_capture_lease_ids(integer, interval), ibex_capture_housekeeping(interval, integer),
    ibex_capture_backlog() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_capture_lease_ids(integer, interval), ibex_capture_housekeeping(interval, integer),
    ibex_capture_backlog(),
    ibex_session_turn_capture_as(uuid, uuid, text, text, text[], text, integer, integer, real, text, text, jsonb,
                                 timestamptz, interval)
    TO ibex_app;

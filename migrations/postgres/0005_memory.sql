-- 0005: the memory service's guards and workers (architecture sections 9.2 and 9.4).
--
-- Called by ibex_dataplane.memory.repository, ibex_dataplane.memory.idempotency and ibex_dataplane.memory.outbox.
--
-- 1. Memories: a trigger keeps `revision` honest (it increments on every change of the record, not on retrieval
--    bookkeeping) and makes `forgotten` terminal, so no write, worker or retry holding an older revision can bring
--    a forgotten memory back, whatever the application does. Nothing becomes `active` again either: a row leaves
--    `active` for good (superseded, forgotten), and a quarantined row is never silently promoted.
-- 2. Idempotency claims carry a token, so only the request that holds the claim can finalize it.
-- 3. Outbox and idempotency housekeeping across tenants through narrow SECURITY DEFINER functions: the data-plane
--    role sees no row without an org, and these functions can only lease due outbox rows, or delete finished or
--    expired ones.
-- 4. The full-text leg of memory search. Under row-level security Postgres may only use an index condition whose
--    operator is leakproof, and `@@` (ts_match_vq) is not, so as the data-plane role every full-text query would be
--    a sequential scan of every tenant's memories. This SECURITY DEFINER function runs the same query with the GIN
--    index, and scopes it itself to the org of the calling tenant transaction (ibex_current_org(), never a
--    parameter: no org set, no rows) and to the given agent (which must be the transaction's agent when one is
--    set). It returns ids and ranks only; the caller hydrates them under row-level security.

CREATE FUNCTION ibex_memories_guard() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.status = 'forgotten' THEN
        RAISE EXCEPTION 'memory % is forgotten', OLD.id USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF NEW.status = 'active' AND OLD.status <> 'active' THEN
        RAISE EXCEPTION 'memory % cannot become active again', OLD.id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF NEW.org_id <> OLD.org_id OR NEW.agent_id <> OLD.agent_id OR NEW.id <> OLD.id THEN
        RAISE EXCEPTION 'a memory never changes owner' USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF (NEW.status, NEW.content, NEW.content_hash, NEW.source, NEW.valid_from, NEW.valid_until, NEW.confidence,
        NEW.usefulness, NEW.positive_feedback, NEW.negative_feedback, NEW.metadata, NEW.observed_at,
        NEW.session_id, NEW.forgotten_at)
       IS DISTINCT FROM
       (OLD.status, OLD.content, OLD.content_hash, OLD.source, OLD.valid_from, OLD.valid_until, OLD.confidence,
        OLD.usefulness, OLD.positive_feedback, OLD.negative_feedback, OLD.metadata, OLD.observed_at,
        OLD.session_id, OLD.forgotten_at)
       OR NEW.embedding IS DISTINCT FROM OLD.embedding THEN
        NEW.revision := OLD.revision + 1;
        NEW.updated_at := now();
    ELSE
        -- Retrieval bookkeeping (retrieval_count, last_retrieved_at) is not a change of the memory.
        NEW.revision := OLD.revision;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER memories_guard BEFORE UPDATE ON memories
    FOR EACH ROW EXECUTE FUNCTION ibex_memories_guard();

-- Room on every page for HOT updates: retrieval bookkeeping (every search bumps its hits) then rewrites no index
-- entry, in particular none of the HNSW graph, whose inserts cost milliseconds.
ALTER TABLE memories SET (fillfactor = 85);

-- Listing an agent's memories by status, newest first, with keyset pagination.
CREATE INDEX memories_by_agent_status ON memories (org_id, agent_id, status, created_at DESC, id DESC);

ALTER TABLE idempotency_keys ADD COLUMN claim_token uuid;

-- Lease up to p_limit due outbox rows of the given kinds, in every org: each comes back with its attempt counted
-- and is hidden from other workers for p_lease. The worker then finishes each row inside the row's own tenant
-- transaction (done, or back off with the error class). Concurrent workers skip each other's rows.
CREATE FUNCTION ibex_outbox_lease(p_kinds text[], p_limit integer, p_lease interval)
    RETURNS TABLE (id bigint, org_id uuid, agent_id uuid, kind text, payload jsonb, attempts integer)
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH due AS (
            SELECT o.id
              FROM public.outbox o
             WHERE o.done_at IS NULL AND o.available_at <= now() AND o.kind = ANY (p_kinds)
             ORDER BY o.available_at, o.id
             LIMIT greatest(p_limit, 0)
               FOR UPDATE SKIP LOCKED
        )
        UPDATE public.outbox o
           SET available_at = now() + p_lease, attempts = o.attempts + 1
          FROM due
         WHERE o.id = due.id
        RETURNING o.id, o.org_id, o.agent_id, o.kind, o.payload, o.attempts
    $$;

-- Delete outbox rows finished more than p_age ago, and idempotency records past their expiry, in every org.
CREATE FUNCTION ibex_memory_housekeeping(p_outbox_age interval, p_limit integer)
    RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
DECLARE
    v_outbox    integer;
    v_keys      integer;
BEGIN
    DELETE FROM public.outbox o
     WHERE o.id IN (SELECT x.id FROM public.outbox x
                     WHERE x.done_at IS NOT NULL AND x.done_at < now() - p_outbox_age
                     LIMIT greatest(p_limit, 0));
    GET DIAGNOSTICS v_outbox = ROW_COUNT;
    DELETE FROM public.idempotency_keys k
     WHERE (k.org_id, k.agent_id, k.key) IN (
            SELECT x.org_id, x.agent_id, x.key FROM public.idempotency_keys x
             WHERE x.expires_at < now() LIMIT greatest(p_limit, 0));
    GET DIAGNOSTICS v_keys = ROW_COUNT;
    RETURN v_outbox + v_keys;
END
$$;

CREATE FUNCTION ibex_memory_text_candidates(
    p_agent         uuid,
    p_query         text,
    p_at            timestamptz,      -- the validity instant; NULL: now
    p_history       boolean,          -- also superseded rows (as_of reads)
    p_min_confidence real,
    p_labels        text[],           -- every one required; empty: no filter
    p_limit         integer)
    RETURNS TABLE (id uuid, rank real)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        SELECT m.id, ts_rank_cd(m.content_tsv, q.query)
          FROM public.memories m, websearch_to_tsquery('english', p_query) AS q (query)
         WHERE m.org_id = public.ibex_current_org()
           AND m.agent_id = p_agent
           AND (public.ibex_current_agent() IS NULL OR m.agent_id = public.ibex_current_agent())
           AND m.content_tsv @@ q.query
           AND (m.status = 'active' OR (p_history AND m.status = 'superseded'))
           AND (m.valid_from IS NULL OR m.valid_from <= coalesce(p_at, now()))
           AND (m.valid_until IS NULL OR m.valid_until > coalesce(p_at, now()))
           AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
           AND (cardinality(p_labels) = 0
                OR (SELECT count(*) FROM public.memory_labels l
                     WHERE l.memory_id = m.id AND l.org_id = m.org_id AND l.label = ANY (p_labels))
                   = cardinality(p_labels))
         ORDER BY 2 DESC, m.id
         LIMIT greatest(p_limit, 0)
    $$;

REVOKE ALL ON FUNCTION ibex_outbox_lease(text[], integer, interval), ibex_memory_housekeeping(interval, integer),
    ibex_memory_text_candidates(uuid, text, timestamptz, boolean, real, text[], integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_outbox_lease(text[], integer, interval), ibex_memory_housekeeping(interval, integer),
    ibex_memory_text_candidates(uuid, text, timestamptz, boolean, real, text[], integer)
    TO ibex_app;

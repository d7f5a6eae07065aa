-- 0025: learned-sparse (SPLADE) term weights of every memory, as per-agent postings, and their scoring function.
--
-- Called by ibex_dataplane.memory.repository: the write path stores each memory's sparse vector (vocabulary token
-- ids and weights, computed by ibex_dataplane.embedding.splade in the embed stage) in memories.sparse_tokens /
-- sparse_weights; the search statement of the sparse leg calls ibex_memory_sparse_postings; the backfill of
-- memories written before this migration calls ibex_memory_sparse_pending and then fills the columns under the
-- tenant's own scope (ibex_dataplane.memory.sparse). See docs/retrieval.md and bench/results/retrieval.md.
--
-- memory_sparse_terms mirrors memory_terms (0012): one row per kept token of every active memory, kept exact by a
-- trigger in the writing transaction. Rows exist while the memory is active and has weights, and disappear when
-- it is superseded, quarantined or forgotten (forget also erases the columns) and with the row through the foreign
-- key. The lookup index (org, agent, token, weight DESC) reads a token's best postings for one agent as one range.
-- (pgvector's sparsevec type would hold the vector, but scoring by the query's tokens needs postings anyway.)
--
-- ibex_memory_sparse_postings scores sum(q_w * d_w) over the query's tokens, reading at most p_max_df postings per
-- token (the highest weights), then checks the best memories against the read fence. Same security shape as 0012:
-- SECURITY DEFINER, scoped to the calling transaction's org, never a parameter, and to its agent when one is set.

ALTER TABLE memories ADD COLUMN sparse_tokens integer[], ADD COLUMN sparse_weights real[];
ALTER TABLE memories ADD CONSTRAINT memories_sparse_shape
    CHECK (cardinality(sparse_tokens) IS NOT DISTINCT FROM cardinality(sparse_weights));

CREATE TABLE memory_sparse_terms (
    memory_id   uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    token       integer NOT NULL,
    org_id      uuid NOT NULL,
    agent_id    uuid NOT NULL,
    weight      real NOT NULL,
    PRIMARY KEY (memory_id, token)
);
CREATE INDEX memory_sparse_terms_lookup ON memory_sparse_terms (org_id, agent_id, token, weight DESC)
    INCLUDE (memory_id);

ALTER TABLE memory_sparse_terms ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_sparse_terms FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_sparse_terms USING (org_id = ibex_current_org())
    WITH CHECK (org_id = ibex_current_org());
CREATE POLICY agent_isolation ON memory_sparse_terms AS RESTRICTIVE
    USING (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent())
    WITH CHECK (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent());
GRANT SELECT, INSERT, DELETE ON memory_sparse_terms TO ibex_app;

CREATE FUNCTION ibex_memory_sparse_sync() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            IF OLD.status = NEW.status AND OLD.sparse_tokens IS NOT DISTINCT FROM NEW.sparse_tokens
               AND OLD.sparse_weights IS NOT DISTINCT FROM NEW.sparse_weights THEN
                RETURN NULL;
            END IF;
            DELETE FROM public.memory_sparse_terms t WHERE t.memory_id = OLD.id;
        END IF;
        IF NEW.status = 'active' AND NEW.sparse_tokens IS NOT NULL THEN
            INSERT INTO public.memory_sparse_terms (memory_id, token, org_id, agent_id, weight)
            SELECT NEW.id, v.token, NEW.org_id, NEW.agent_id, max(v.weight)
              FROM unnest(NEW.sparse_tokens, NEW.sparse_weights) AS v (token, weight)
             WHERE v.weight > 0
             GROUP BY v.token;
        END IF;
        RETURN NULL;
    END
    $$;

CREATE TRIGGER memories_sparse_sync
    AFTER INSERT OR UPDATE OF status, sparse_tokens, sparse_weights ON memories
    FOR EACH ROW EXECUTE FUNCTION ibex_memory_sparse_sync();

-- Memories written before this migration have no weights: the backfill finds them here, any org (ids and owners
-- only; the content is read and the weights written in each tenant's own transaction, under row-level security).
CREATE INDEX memories_sparse_pending ON memories (created_at, id)
    WHERE status = 'active' AND sparse_tokens IS NULL AND content IS NOT NULL;

CREATE FUNCTION ibex_memory_sparse_pending(p_limit integer)
    RETURNS TABLE (id uuid, org_id uuid, agent_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        SELECT m.id, m.org_id, m.agent_id FROM public.memories m
         WHERE m.status = 'active' AND m.sparse_tokens IS NULL AND m.content IS NOT NULL
         ORDER BY m.created_at, m.id
         LIMIT greatest(p_limit, 0)
    $$;

REVOKE ALL ON FUNCTION ibex_memory_sparse_pending(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_sparse_pending(integer) TO ibex_app;

CREATE FUNCTION ibex_memory_sparse_postings(
    p_agent          uuid,
    p_tokens         integer[],
    p_weights        real[],
    p_min_confidence real,
    p_labels         text[],           -- every one required; empty: no filter
    p_limit          integer,
    p_max_df         integer)          -- postings read per query token (the highest weights)
    RETURNS TABLE (id uuid, score real, terms integer)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH scope AS MATERIALIZED (
            SELECT public.ibex_current_org() AS org, now() AS at
             WHERE public.ibex_current_agent() IS NULL OR public.ibex_current_agent() = p_agent
        ), query AS MATERIALIZED (
            SELECT q.token, max(q.weight) AS weight
              FROM unnest(p_tokens, p_weights) AS q (token, weight)
             WHERE q.weight > 0
             GROUP BY q.token
        ), scored AS MATERIALIZED (
            SELECT x.memory_id AS id, sum(q.weight * x.weight) AS score, count(*)::integer AS terms
              FROM query q, scope s
             CROSS JOIN LATERAL (
                SELECT p.memory_id, p.weight FROM public.memory_sparse_terms p
                 WHERE p.org_id = s.org AND p.agent_id = p_agent AND p.token = q.token
                 ORDER BY p.weight DESC
                 LIMIT greatest(p_max_df, 1)
             ) x
             GROUP BY x.memory_id
             ORDER BY 2 DESC, 1
             LIMIT greatest(p_limit, 0) * 2 + 20  -- room for the rows the fence below drops
        )
        SELECT x.id, x.score::real, x.terms
          FROM scored x, scope s
         WHERE EXISTS (
                SELECT 1 FROM public.memories m
                 WHERE m.id = x.id AND m.org_id = s.org AND m.agent_id = p_agent AND m.status = 'active'
                   AND (m.valid_from IS NULL OR m.valid_from <= s.at)
                   AND (m.valid_until IS NULL OR m.valid_until > s.at)
                   AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
                   AND (cardinality(p_labels) = 0
                        OR (SELECT count(*) FROM public.memory_labels l
                             WHERE l.memory_id = m.id AND l.org_id = m.org_id AND l.label = ANY (p_labels))
                           = cardinality(p_labels)))
         ORDER BY x.score DESC, x.id
         LIMIT greatest(p_limit, 0)
    $$;

REVOKE ALL ON FUNCTION ibex_memory_sparse_postings(uuid, integer[], real[], real, text[], integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_sparse_postings(uuid, integer[], real[], real, text[], integer, integer)
    TO ibex_app;

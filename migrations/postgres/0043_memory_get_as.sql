-- 0043: reading memories by id in one round trip.
--
-- Called by ibex_dataplane.memory.repository (get_many: GET /v1/memories/{id} and the hot memories, which the
-- context stage's hot branch asks for on every assembly). get_many was an explicit read-only transaction: BEGIN,
-- the tenant scope, the statement, COMMIT, four round trips for one SELECT. Like the search legs' functions of
-- 0039, this one takes the tenant as its first two arguments, sets it for the current transaction and returns the
-- rows: one statement, one round trip. It runs as the caller (SECURITY INVOKER), so row-level security applies to
-- every row it reads. The statement is the one the repository sent, read at now: active memories inside their
-- validity, and superseded ones only when asked; the retrieval bookkeeping comes from memory_retrievals (0042).

CREATE FUNCTION ibex_memory_get_as(p_org uuid, p_agent uuid, p_ids uuid[], p_include_superseded boolean)
    RETURNS TABLE (
        id uuid, agent_id uuid, content text, status text, source text, confidence real, usefulness real,
        valid_from timestamptz, valid_until timestamptz, observed_at timestamptz, session_id text, metadata jsonb,
        revision bigint, retrieval_count integer, last_retrieved_at timestamptz, created_at timestamptz,
        updated_at timestamptz, positive_feedback integer, negative_feedback integer, labels text[])
    LANGUAGE plpgsql VOLATILE
    AS $$
#variable_conflict use_column
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    RETURN QUERY
    SELECT m.id, m.agent_id, m.content, m.status, m.source, m.confidence, m.usefulness, m.valid_from,
           m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision,
           coalesce(r.retrieval_count, 0), r.last_retrieved_at, m.created_at, m.updated_at,
           m.positive_feedback, m.negative_feedback,
           coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                    '{}') AS labels
      FROM memories m
      LEFT JOIN memory_retrievals r ON r.memory_id = m.id
     WHERE m.org_id = p_org AND m.agent_id = p_agent AND m.id = ANY(p_ids)
       AND ((m.status = 'active'
             AND (m.valid_from IS NULL OR m.valid_from <= now()) AND (m.valid_until IS NULL OR m.valid_until > now()))
            OR (m.status = 'superseded' AND p_include_superseded));
END
$$;

REVOKE ALL ON FUNCTION ibex_memory_get_as(uuid, uuid, uuid[], boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_get_as(uuid, uuid, uuid[], boolean) TO ibex_app;

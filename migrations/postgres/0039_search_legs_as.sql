-- 0039: the three legs of a current search, one round trip each.
--
-- Called by ibex_dataplane.memory.repository (search_vector, search_text and search_sparse for reads of now). Each
-- leg was an explicit transaction of five round trips: BEGIN, the tenant scope, the planner settings, the
-- statement, COMMIT; three legs made fifteen per search, and each leg's COMMIT sat on the search's critical path.
-- These *_as functions (the pattern of 0009) take the tenant as their first two arguments, set app.org_id /
-- app.agent_id and the planner settings for the current transaction, then return the leg's hydrated rows: a single
-- statement, its own transaction, one round trip. They run as the caller (SECURITY INVOKER), so row-level security
-- applies to every row they read, as it did. The statements are those the repository sent before (the legs'
-- candidates, then each hit hydrated through the primary key with the read fence applied again); reads of a past
-- instant keep the explicit transaction.
--
-- The settings (see MemoryRepository._ann_settings): pgvector's iterative scan with relaxed order and ef_search,
-- no sequential scans or explicit sorts, and generic plans; all transaction-local, so they end with the statement.
-- They are set before a function's query is first planned, so its cached plan is made under them.

CREATE FUNCTION ibex_search_settings(p_ef_search integer) RETURNS void
    LANGUAGE sql VOLATILE
    AS $$
        SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),
               set_config('hnsw.ef_search', p_ef_search::text, true),
               set_config('enable_seqscan', 'off', true),
               set_config('enable_sort', 'off', true),
               set_config('plan_cache_mode', 'force_generic_plan', true)
    $$;

CREATE FUNCTION ibex_memory_search_vector_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_vector         vector,
    p_candidates     integer,
    p_min_similarity double precision,
    p_min_confidence real,             -- NULL: no filter
    p_labels         text[])           -- every one required; empty: no filter
    RETURNS TABLE (
        similarity double precision, text_score real, text_terms integer,
        id uuid, agent_id uuid, content text, status text, source text, confidence real, usefulness real,
        valid_from timestamptz, valid_until timestamptz, observed_at timestamptz, session_id text, metadata jsonb,
        revision bigint, retrieval_count integer, last_retrieved_at timestamptz, created_at timestamptz,
        updated_at timestamptz, positive_feedback integer, negative_feedback integer, labels text[])
    LANGUAGE plpgsql VOLATILE
    AS $$
#variable_conflict use_column
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    PERFORM ibex_search_settings(p_ef_search);
    RETURN QUERY
    WITH ann AS MATERIALIZED (
        SELECT m.id, 1 - (m.embedding <=> p_vector) AS similarity, NULL::real AS text_score, 0 AS text_terms
          FROM memories m
         WHERE m.org_id = p_org AND m.agent_id = p_agent AND m.embedding IS NOT NULL
           AND (m.valid_from IS NULL OR m.valid_from <= now()) AND (m.valid_until IS NULL OR m.valid_until > now())
           AND m.status = 'active'
           AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
           AND (cardinality(p_labels) = 0
                OR (SELECT count(*) FROM memory_labels l WHERE l.memory_id = m.id AND l.label = ANY(p_labels))
                   = cardinality(p_labels))
         ORDER BY m.embedding <=> p_vector
         LIMIT p_candidates
    )
    SELECT h.similarity, h.text_score, h.text_terms, x.*
      FROM (SELECT * FROM ann WHERE ann.similarity >= p_min_similarity) h
     CROSS JOIN LATERAL (
        SELECT m.id, m.agent_id, m.content, m.status, m.source, m.confidence, m.usefulness, m.valid_from,
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision, m.retrieval_count,
               m.last_retrieved_at, m.created_at, m.updated_at, m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
         WHERE m.org_id = p_org AND m.agent_id = p_agent
           AND (m.valid_from IS NULL OR m.valid_from <= now()) AND (m.valid_until IS NULL OR m.valid_until > now())
           AND m.status = 'active'
           AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
           AND (cardinality(p_labels) = 0
                OR (SELECT count(*) FROM memory_labels l WHERE l.memory_id = m.id AND l.label = ANY(p_labels))
                   = cardinality(p_labels))
        OFFSET 0  -- keeps the subquery per hit, never a hash join over the whole table
     ) x;
END
$$;

CREATE FUNCTION ibex_memory_search_text_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_query          text,
    p_candidates     integer,
    p_min_confidence real,
    p_labels         text[],
    p_term_rows      integer,          -- postings read per query term
    p_population     integer)          -- the agent's active memories (N of idf), counted by the caller
    RETURNS TABLE (
        similarity double precision, text_score real, text_terms integer,
        id uuid, agent_id uuid, content text, status text, source text, confidence real, usefulness real,
        valid_from timestamptz, valid_until timestamptz, observed_at timestamptz, session_id text, metadata jsonb,
        revision bigint, retrieval_count integer, last_retrieved_at timestamptz, created_at timestamptz,
        updated_at timestamptz, positive_feedback integer, negative_feedback integer, labels text[])
    LANGUAGE plpgsql VOLATILE
    AS $$
#variable_conflict use_column
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    PERFORM ibex_search_settings(p_ef_search);
    RETURN QUERY
    WITH fts AS MATERIALIZED (
        SELECT t.id, NULL::float8 AS similarity, t.score AS text_score, t.terms AS text_terms
          FROM ibex_memory_text_bm25_given_n(p_agent, p_query, p_min_confidence, p_labels, p_candidates,
                                             p_term_rows, p_population) t
    )
    SELECT h.similarity, h.text_score, h.text_terms, x.*
      FROM fts h
     CROSS JOIN LATERAL (
        SELECT m.id, m.agent_id, m.content, m.status, m.source, m.confidence, m.usefulness, m.valid_from,
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision, m.retrieval_count,
               m.last_retrieved_at, m.created_at, m.updated_at, m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
         WHERE m.org_id = p_org AND m.agent_id = p_agent
           AND (m.valid_from IS NULL OR m.valid_from <= now()) AND (m.valid_until IS NULL OR m.valid_until > now())
           AND m.status = 'active'
           AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
           AND (cardinality(p_labels) = 0
                OR (SELECT count(*) FROM memory_labels l WHERE l.memory_id = m.id AND l.label = ANY(p_labels))
                   = cardinality(p_labels))
        OFFSET 0
     ) x;
END
$$;

CREATE FUNCTION ibex_memory_search_sparse_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_tokens         integer[],
    p_weights        real[],
    p_candidates     integer,
    p_min_confidence real,
    p_labels         text[],
    p_term_rows      integer)          -- postings read per query token
    RETURNS TABLE (
        similarity double precision, text_score real, text_terms integer,
        id uuid, agent_id uuid, content text, status text, source text, confidence real, usefulness real,
        valid_from timestamptz, valid_until timestamptz, observed_at timestamptz, session_id text, metadata jsonb,
        revision bigint, retrieval_count integer, last_retrieved_at timestamptz, created_at timestamptz,
        updated_at timestamptz, positive_feedback integer, negative_feedback integer, labels text[])
    LANGUAGE plpgsql VOLATILE
    AS $$
#variable_conflict use_column
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    PERFORM ibex_search_settings(p_ef_search);
    RETURN QUERY
    WITH fts AS MATERIALIZED (
        SELECT t.id, NULL::float8 AS similarity, t.score AS text_score, t.terms AS text_terms
          FROM ibex_memory_sparse_postings(p_agent, p_tokens, p_weights, p_min_confidence, p_labels, p_candidates,
                                           p_term_rows) t
    )
    SELECT h.similarity, h.text_score, h.text_terms, x.*
      FROM fts h
     CROSS JOIN LATERAL (
        SELECT m.id, m.agent_id, m.content, m.status, m.source, m.confidence, m.usefulness, m.valid_from,
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision, m.retrieval_count,
               m.last_retrieved_at, m.created_at, m.updated_at, m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
         WHERE m.org_id = p_org AND m.agent_id = p_agent
           AND (m.valid_from IS NULL OR m.valid_from <= now()) AND (m.valid_until IS NULL OR m.valid_until > now())
           AND m.status = 'active'
           AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
           AND (cardinality(p_labels) = 0
                OR (SELECT count(*) FROM memory_labels l WHERE l.memory_id = m.id AND l.label = ANY(p_labels))
                   = cardinality(p_labels))
        OFFSET 0
     ) x;
END
$$;

REVOKE ALL ON FUNCTION ibex_search_settings(integer),
    ibex_memory_search_vector_as(uuid, uuid, integer, vector, integer, double precision, real, text[]),
    ibex_memory_search_text_as(uuid, uuid, integer, text, integer, real, text[], integer, integer),
    ibex_memory_search_sparse_as(uuid, uuid, integer, integer[], real[], integer, real, text[], integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_search_settings(integer),
    ibex_memory_search_vector_as(uuid, uuid, integer, vector, integer, double precision, real, text[]),
    ibex_memory_search_text_as(uuid, uuid, integer, text, integer, real, text[], integer, integer),
    ibex_memory_search_sparse_as(uuid, uuid, integer, integer[], real[], integer, real, text[], integer)
    TO ibex_app;

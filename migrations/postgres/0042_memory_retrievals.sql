-- 0042: retrieval bookkeeping moves out of memories into a narrow table of its own.
--
-- Called by ibex_dataplane.memory.repository: the retrieval log's flush (record_retrievals) and exact dedup
-- (bump_duplicates) upsert here; every read of a memory takes retrieval_count and last_retrieved_at from here (the
-- repository's column list, and the three search legs' hydration redefined below).
--
-- Every search bumps the count of what it returned, and the retrieval log writes those bumps as one statement per
-- agent every half second. On memories that statement rewrote whole rows (about 2 kB each: the embedding, the
-- sparse vector, the text): fillfactor 85 (0005) made most of those updates HOT, but not all, and every row that
-- did not fit on its page got new entries in each index of memories, the HNSW graph's included. Measured in the
-- memory benchmark at 5,000 memories (600 searches): 89 % of the bumps were HOT; each flush (about 250 rows) took
-- 35-100 ms and touched 20,000-23,000 buffers, on the two cores the searches use. Here a bump is an update of a
-- 60-byte row whose only index is its primary key: the same flushes took 4-18 ms and touched about 2,000 buffers
-- (bench/results/memory.txt). The update is HOT whenever its page has room (fillfactor 80), and even when not, the
-- primary key is the only index to maintain.
--
-- The table holds a row only for a memory returned at least once; no row reads as a count of 0 and no time. It has
-- no foreign key (a key check locks the memory's row, which is the write this table avoids); rows leave with their
-- memory's tenant, whose purge deletes every table that carries org_id (memories are never deleted otherwise, see
-- 0040). A forgotten memory keeps its row, as it kept the columns. The guard trigger of memories (0005) still
-- names retrieval bookkeeping in its comment; it no longer sees any.

CREATE TABLE memory_retrievals (
    memory_id         uuid PRIMARY KEY,
    org_id            uuid NOT NULL,
    agent_id          uuid NOT NULL,
    retrieval_count   integer NOT NULL CHECK (retrieval_count > 0),
    last_retrieved_at timestamptz NOT NULL
) WITH (fillfactor = 80);

INSERT INTO memory_retrievals (memory_id, org_id, agent_id, retrieval_count, last_retrieved_at)
SELECT m.id, m.org_id, m.agent_id, m.retrieval_count, coalesce(m.last_retrieved_at, m.updated_at)
  FROM memories m
 WHERE m.retrieval_count > 0;

ALTER TABLE memories DROP COLUMN retrieval_count, DROP COLUMN last_retrieved_at;

ALTER TABLE memory_retrievals ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_retrievals FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_retrievals USING (org_id = (SELECT ibex_current_org()))
    WITH CHECK (org_id = (SELECT ibex_current_org()));
CREATE POLICY agent_isolation ON memory_retrievals AS RESTRICTIVE
    USING ((SELECT ibex_current_agent()) IS NULL OR agent_id = (SELECT ibex_current_agent()))
    WITH CHECK ((SELECT ibex_current_agent()) IS NULL OR agent_id = (SELECT ibex_current_agent()));
GRANT SELECT, INSERT, UPDATE ON memory_retrievals TO ibex_app;

-- The three legs of a current search (0039), hydrated as before with the two columns read from here: one primary
-- key probe per hit, a hit never returned before has no row.
CREATE OR REPLACE FUNCTION ibex_memory_search_vector_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_vector         vector,
    p_candidates     integer,
    p_min_similarity double precision,
    p_min_confidence real,
    p_labels         text[])
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
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision,
               coalesce(r.retrieval_count, 0), r.last_retrieved_at, m.created_at, m.updated_at,
               m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
          LEFT JOIN memory_retrievals r ON r.memory_id = m.id
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

CREATE OR REPLACE FUNCTION ibex_memory_search_text_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_query          text,
    p_candidates     integer,
    p_min_confidence real,
    p_labels         text[],
    p_term_rows      integer,
    p_population     integer)
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
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision,
               coalesce(r.retrieval_count, 0), r.last_retrieved_at, m.created_at, m.updated_at,
               m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
          LEFT JOIN memory_retrievals r ON r.memory_id = m.id
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

CREATE OR REPLACE FUNCTION ibex_memory_search_sparse_as(
    p_org            uuid,
    p_agent          uuid,
    p_ef_search      integer,
    p_tokens         integer[],
    p_weights        real[],
    p_candidates     integer,
    p_min_confidence real,
    p_labels         text[],
    p_term_rows      integer)
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
               m.valid_until, m.observed_at, m.session_id, m.metadata, m.revision,
               coalesce(r.retrieval_count, 0), r.last_retrieved_at, m.created_at, m.updated_at,
               m.positive_feedback, m.negative_feedback,
               coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id),
                        '{}') AS labels
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
          LEFT JOIN memory_retrievals r ON r.memory_id = m.id
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

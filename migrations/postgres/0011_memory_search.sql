-- 0011: the full-text leg of memory search ranks with BM25 over any query term (architecture section 9.3).
--
-- Called by ibex_dataplane.memory.repository (the search statement). Replaces, for search, the function of
-- migration 0005, which matched every word of the query (websearch_to_tsquery is AND) and ranked with
-- ts_rank_cd: a natural question rarely has all of its words in one memory, so most questions found nothing.
--
-- ibex_memory_text_bm25 takes the query's lexemes (the same 'english' configuration as content_tsv, so stop
-- words are gone and words are stemmed) and, for each, the agent's matching memories through the GIN index, at
-- most p_max_df of them. A term's document frequency is that count; a term matched by more than p_max_df
-- memories is too common to select candidates (its rows are an arbitrary sample), but it still scores in the
-- memories found through rarer terms. Each candidate gets Okapi BM25 (k1 = 1.2, b = 0.75) over every query term
-- it holds: idf = ln(1 + (N - df + 0.5) / (df + 0.5)) with N the agent's readable memories (counted up to
-- p_max_n, and at least 200: in a young agent's handful of memories every term would otherwise look common and a
-- plain match would score next to nothing), term frequency from the tsvector's positions and length in lexemes against the candidates' mean.
-- Scores are absolute (not normalized per query), so a caller can put a floor under them.
--
-- Same security shape as ibex_memory_text_candidates: SECURITY DEFINER so `@@` can use the GIN index under
-- row-level security, scoped to the org of the calling tenant transaction (never a parameter) and the given
-- agent, which must be the transaction's agent when one is set; it returns ids and scores only.

CREATE FUNCTION ibex_memory_text_bm25(
    p_agent          uuid,
    p_query          text,
    p_at             timestamptz,      -- the validity instant; NULL: now
    p_history        boolean,          -- also superseded rows (as_of reads)
    p_min_confidence real,
    p_labels         text[],           -- every one required; empty: no filter
    p_limit          integer,
    p_max_df         integer,          -- rows read per term
    p_max_n          integer)          -- memories counted for idf
    RETURNS TABLE (id uuid, score real, terms integer)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH readable AS MATERIALIZED (
            -- The fence of every retrieval read, as a predicate over one row.
            SELECT public.ibex_current_org() AS org,
                   coalesce(p_at, now()) AS at
        ), terms AS MATERIALIZED (
            SELECT DISTINCT t.lexeme FROM unnest(to_tsvector('english', p_query)) AS t
        ), matches AS MATERIALIZED (
            SELECT t.lexeme, x.id
              FROM terms t, readable r
             CROSS JOIN LATERAL (
                SELECT m.id FROM public.memories m
                 WHERE m.content_tsv @@ quote_literal(t.lexeme)::tsquery
                   AND m.org_id = r.org
                   AND m.agent_id = p_agent
                   AND (public.ibex_current_agent() IS NULL OR m.agent_id = public.ibex_current_agent())
                   AND (m.status = 'active' OR (p_history AND m.status = 'superseded'))
                   AND (m.valid_from IS NULL OR m.valid_from <= r.at)
                   AND (m.valid_until IS NULL OR m.valid_until > r.at)
                   AND (p_min_confidence IS NULL OR m.confidence >= p_min_confidence)
                   AND (cardinality(p_labels) = 0
                        OR (SELECT count(*) FROM public.memory_labels l
                             WHERE l.memory_id = m.id AND l.org_id = m.org_id AND l.label = ANY (p_labels))
                           = cardinality(p_labels))
                 LIMIT greatest(p_max_df, 1)
             ) x
        ), df AS (
            SELECT lexeme, count(*)::float8 AS n FROM matches GROUP BY lexeme
        ), population AS (
            SELECT greatest(count(*), 200)::float8 AS n FROM (
                SELECT 1 FROM public.memories m, readable r
                 WHERE m.org_id = r.org AND m.agent_id = p_agent
                   AND (public.ibex_current_agent() IS NULL OR m.agent_id = public.ibex_current_agent())
                   AND m.status = 'active'
                 LIMIT greatest(p_max_n, 1)
            ) a
        ), candidates AS MATERIALIZED (
            SELECT x.id, x.content_tsv, greatest(length(x.content_tsv), 1)::float8 AS len
              FROM (SELECT DISTINCT mt.id FROM matches mt) u
             CROSS JOIN LATERAL (
                SELECT m.id, m.content_tsv FROM public.memories m WHERE m.id = u.id
                OFFSET 0  -- a primary-key lookup per candidate, never a scan of the table
             ) x
        ), lengths AS (
            SELECT greatest(avg(len), 1) AS mean FROM candidates
        ), scored AS (
            SELECT c.id,
                   sum(ln(1 + (greatest(p.n, d.n) - d.n + 0.5) / (d.n + 0.5))
                       * (tf.n * 2.2) / (tf.n + 1.2 * (0.25 + 0.75 * c.len / l.mean))) AS score,
                   count(*)::integer AS terms
              FROM candidates c
             CROSS JOIN lengths l
             CROSS JOIN population p
             CROSS JOIN LATERAL (
                SELECT v.lexeme, coalesce(array_length(v.positions, 1), 1)::float8 AS n
                  FROM unnest(c.content_tsv) AS v
                 WHERE v.lexeme IN (SELECT lexeme FROM terms)
             ) tf
              JOIN df d ON d.lexeme = tf.lexeme
             GROUP BY c.id
        )
        SELECT s.id, s.score::real, s.terms FROM scored s
         ORDER BY s.score DESC, s.id
         LIMIT greatest(p_limit, 0)
    $$;

REVOKE ALL ON FUNCTION ibex_memory_text_bm25(uuid, text, timestamptz, boolean, real, text[], integer, integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_text_bm25(uuid, text, timestamptz, boolean, real, text[], integer, integer, integer)
    TO ibex_app;

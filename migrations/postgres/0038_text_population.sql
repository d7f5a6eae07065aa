-- 0038: the text leg's idf population comes from the caller.
--
-- Called by ibex_dataplane.memory.repository (the text leg of search). BM25's N, the agent's active memories, was
-- counted by every call: a scan of up to p_max_n rows of memories per search, measured at 10,000 memories as half
-- of the function's time (4.6 of 9 ms) and growing with the agent up to the cap. The memory stage now counts an
-- agent's memories at most once a minute (the count moves slowly, and idf only needs its order of magnitude) and
-- passes it in: ibex_memory_text_bm25_given_n is 0033's function with p_population (floored at 200, as before) in
-- place of the count. The function of 0012/0033 stays for a memory stage of the previous release during a rolling
-- upgrade: it now counts as it did and calls the new one.

CREATE FUNCTION ibex_memory_text_bm25_given_n(
    p_agent          uuid,
    p_query          text,
    p_min_confidence real,
    p_labels         text[],           -- every one required; empty: no filter
    p_limit          integer,
    p_max_df         integer,          -- postings read per term
    p_population     integer)          -- the agent's active memories (N of idf), counted by the caller
    RETURNS TABLE (id uuid, score real, terms integer)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH scope AS MATERIALIZED (
            SELECT public.ibex_current_org() AS org, now() AS at
             WHERE public.ibex_current_agent() IS NULL OR public.ibex_current_agent() = p_agent
        ), terms AS MATERIALIZED (
            SELECT DISTINCT t.lexeme FROM unnest(to_tsvector('english', p_query)) AS t
        ), sampled AS MATERIALIZED (
            SELECT t.lexeme, x.memory_id, x.tf, x.doc_len
              FROM terms t, scope s
             CROSS JOIN LATERAL (
                SELECT p.memory_id, p.tf, p.doc_len FROM public.memory_terms p
                 WHERE p.org_id = s.org AND p.agent_id = p_agent AND p.lexeme = t.lexeme
                 LIMIT greatest(p_max_df, 1)
             ) x
        ), df AS MATERIALIZED (
            SELECT lexeme, count(*)::float8 AS n FROM sampled GROUP BY lexeme
        ), rare AS MATERIALIZED (
            SELECT s.* FROM sampled s JOIN df d USING (lexeme) WHERE d.n < greatest(p_max_df, 1)
        ), common_terms AS MATERIALIZED (
            SELECT d.lexeme FROM df d WHERE d.n >= greatest(p_max_df, 1)
        ), found AS MATERIALIZED (
            SELECT array_agg(DISTINCT r.memory_id) AS ids FROM rare r
        ), common AS MATERIALIZED (
            -- Too common to select: scores only in memories the rarer terms found, one key probe each.
            SELECT c.lexeme, p.memory_id, p.tf, p.doc_len
              FROM common_terms c
             CROSS JOIN found f
             CROSS JOIN scope s
             CROSS JOIN LATERAL (
                SELECT p.memory_id, p.tf, p.doc_len FROM public.memory_terms p
                 WHERE p.org_id = s.org AND p.agent_id = p_agent AND p.lexeme = c.lexeme
                   AND p.memory_id = ANY (f.ids)
                OFFSET 0  -- one probe per common term, never a scan of the agent's postings
             ) p
        ), postings AS (
            SELECT * FROM rare UNION ALL SELECT * FROM common
        ), population AS (
            SELECT greatest(coalesce(p_population, 0), 200)::float8 AS n
        ), lengths AS (
            SELECT greatest(avg(doc_len), 1) AS mean FROM sampled
        ), scored AS MATERIALIZED (
            SELECT p.memory_id AS id,
                   sum(ln(1 + (greatest(n.n, d.n) - d.n + 0.5) / (d.n + 0.5))
                       * (p.tf * 2.2) / (p.tf + 1.2 * (0.25 + 0.75 * p.doc_len / l.mean))) AS score,
                   count(*)::integer AS terms
              FROM postings p
              JOIN df d ON d.lexeme = p.lexeme
             CROSS JOIN lengths l
             CROSS JOIN population n
             GROUP BY p.memory_id
             ORDER BY 2 DESC, 1
             LIMIT greatest(p_limit, 0) * 2 + 20  -- room for the rows the fence below drops
        )
        SELECT x.id, x.score::real, x.terms
          FROM scored x, scope s
         WHERE EXISTS (
                SELECT 1 FROM (SELECT * FROM public.memories m WHERE m.id = x.id OFFSET 0) m
                 WHERE m.org_id = s.org AND m.agent_id = p_agent AND m.status = 'active'
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

CREATE OR REPLACE FUNCTION ibex_memory_text_bm25_postings(
    p_agent          uuid,
    p_query          text,
    p_min_confidence real,
    p_labels         text[],           -- every one required; empty: no filter
    p_limit          integer,
    p_max_df         integer,          -- postings read per term
    p_max_n          integer)          -- memories counted for idf
    RETURNS TABLE (id uuid, score real, terms integer)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        SELECT t.id, t.score, t.terms
          FROM public.ibex_memory_text_bm25_given_n(
                p_agent, p_query, p_min_confidence, p_labels, p_limit, p_max_df,
                (SELECT count(*)::integer FROM (
                    SELECT 1 FROM public.memories m
                     WHERE m.org_id = public.ibex_current_org() AND m.agent_id = p_agent AND m.status = 'active'
                     LIMIT greatest(p_max_n, 1)
                 ) a)) t
    $$;

REVOKE ALL ON FUNCTION ibex_memory_text_bm25_given_n(uuid, text, real, text[], integer, integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_text_bm25_given_n(uuid, text, real, text[], integer, integer, integer)
    TO ibex_app;

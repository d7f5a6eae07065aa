-- 0033: the read fence of the two postings functions probes each scored memory through the primary key.
--
-- Called by ibex_dataplane.memory.repository (the text and sparse legs of search). Both functions end by keeping
-- the best scored memories that pass the read fence (active, valid now, confidence, labels). Written as a plain
-- EXISTS, the planner turned it into a semi join that walked every active memory of the agent once per scored row
-- (or once, materialized), filtering by id: measured on a 419-memory LoCoMo agent, 13 of the sparse function's
-- 17 ms and 2 of the text function's 4, and growing with the agent. The subquery below names the primary key
-- alone and keeps the rest of the fence outside an OFFSET 0, so each scored row is one index probe whatever the
-- statistics say. Bodies otherwise as in migrations 0012 and 0025.

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
            SELECT greatest(count(*), 200)::float8 AS n FROM (
                SELECT 1 FROM public.memories m, scope s
                 WHERE m.org_id = s.org AND m.agent_id = p_agent AND m.status = 'active'
                 LIMIT greatest(p_max_n, 1)
            ) a
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

CREATE OR REPLACE FUNCTION ibex_memory_sparse_postings(
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

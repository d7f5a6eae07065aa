-- 0012: per-agent postings for the BM25 leg of memory search, maintained at write time (architecture section 9.3).
--
-- Called by ibex_dataplane.memory.repository (the search statement, current reads). Migration 0011's
-- ibex_memory_text_bm25 counted each query term's document frequency by walking the GIN index over content_tsv
-- (every tenant's rows, filtered by agent afterwards) and then fetched every candidate's tsvector to unnest it
-- for term frequencies: about 11 ms of a 14 ms search statement on a 663-memory agent, and growing with the
-- whole table, not with the agent.
--
-- memory_terms holds, for every active memory, one row per distinct lexeme of its content_tsv: the term
-- frequency and the memory's length in lexemes. The primary key (org, agent, lexeme, memory) carries both as
-- INCLUDE columns, so a term's postings for one agent are one index range, read without the table. A trigger on
-- memories keeps it exact in the writing transaction: postings exist while a row is active and disappear when it
-- is superseded, quarantined or forgotten (and with the row, through the foreign key). Superseded rows keep no
-- postings: history reads (as_of) still go through ibex_memory_text_bm25 of migration 0011.
--
-- ibex_memory_text_bm25_postings scores like ibex_memory_text_bm25 (Okapi BM25, k1 = 1.2, b = 0.75, any query
-- lexeme, idf from N = the agent's active memories counted up to p_max_n and at least 200) with its statistics from
-- the postings. A term with more than p_max_df postings is too common to select candidates: its df is counted up
-- to p_max_df and it scores only the memories rarer terms found (a primary-key probe each). The best scored
-- memories are then checked against the read fence (validity, confidence, labels) through the primary key.
-- Same security shape as 0011: SECURITY DEFINER, scoped to the calling transaction's org, never a parameter.

CREATE TABLE memory_terms (
    org_id      uuid NOT NULL,
    agent_id    uuid NOT NULL,
    lexeme      text NOT NULL,
    memory_id   uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    tf          real NOT NULL,
    doc_len     real NOT NULL,
    PRIMARY KEY (org_id, agent_id, lexeme, memory_id) INCLUDE (tf, doc_len)
);
CREATE INDEX memory_terms_memory ON memory_terms (memory_id);

CREATE FUNCTION ibex_memory_terms_sync() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            IF OLD.status = NEW.status AND OLD.content_tsv IS NOT DISTINCT FROM NEW.content_tsv THEN
                RETURN NULL;  -- retrieval bookkeeping, feedback, validity: the postings stay as they are
            END IF;
            IF OLD.status = 'active' THEN
                DELETE FROM public.memory_terms t WHERE t.memory_id = OLD.id;
            END IF;
        END IF;
        IF NEW.status = 'active' AND NEW.content_tsv IS NOT NULL THEN
            INSERT INTO public.memory_terms (org_id, agent_id, lexeme, memory_id, tf, doc_len)
            SELECT NEW.org_id, NEW.agent_id, v.lexeme, NEW.id, coalesce(array_length(v.positions, 1), 1),
                   greatest(length(NEW.content_tsv), 1)
              FROM unnest(NEW.content_tsv) AS v;
        END IF;
        RETURN NULL;
    END
    $$;

CREATE TRIGGER memories_terms_sync
    AFTER INSERT OR UPDATE OF status, content ON memories
    FOR EACH ROW EXECUTE FUNCTION ibex_memory_terms_sync();

-- Memories written before this migration.
INSERT INTO memory_terms (org_id, agent_id, lexeme, memory_id, tf, doc_len)
SELECT m.org_id, m.agent_id, v.lexeme, m.id, coalesce(array_length(v.positions, 1), 1),
       greatest(length(m.content_tsv), 1)
  FROM memories m CROSS JOIN LATERAL unnest(m.content_tsv) AS v
 WHERE m.status = 'active';

ALTER TABLE memory_terms ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_terms FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_terms USING (org_id = ibex_current_org())
    WITH CHECK (org_id = ibex_current_org());
CREATE POLICY agent_isolation ON memory_terms AS RESTRICTIVE
    USING (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent())
    WITH CHECK (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent());
GRANT SELECT, INSERT, DELETE ON memory_terms TO ibex_app;

CREATE FUNCTION ibex_memory_text_bm25_postings(
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

REVOKE ALL ON FUNCTION ibex_memory_text_bm25_postings(uuid, text, real, text[], integer, integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_memory_text_bm25_postings(uuid, text, real, text[], integer, integer, integer)
    TO ibex_app;

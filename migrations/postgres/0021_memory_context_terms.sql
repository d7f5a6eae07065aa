-- 0021: conversation context in the BM25 postings. A memory written in a session is also indexed by the words of
-- the memory observed just before it in the same session (its context).
--
-- Called by nothing directly: triggers keep it, and the search statement of migration 0012 reads memory_terms as
-- before. Why: in a conversation the fact often sits in a reply whose own words say little ("The Minnesota Wolves!")
-- while the turn before it holds the question's words ("Which team did you sign with?"). Indexing each turn with
-- the words of the turn it answers lifted evidence recall@10 on the LoCoMo development split by about 0.05 (see
-- bench/results/retrieval.md); the vector leg and the returned content are unchanged.
--
-- 1. memory_context links a memory to its context (ibex_memory_context_of): the memory of the same org, agent and
--    session, active or superseded, observed last strictly before it (observed_at, else valid_from, else
--    created_at). The link is
--    made when the memory's transaction commits (a deferred constraint trigger), so a batch that inserts its turns
--    in any order (the persist stage orders inserts by content hash) still links each turn to the one before it.
--    A turn written in a later transaction than the turn after it does not become that turn's context.
-- 2. The memory's postings are then rebuilt from its own lexemes and its context's (tsvector concatenation: term
--    frequencies add up, the document length is the merged lexeme count).
-- 3. Forgetting a memory removes its words from every memory that took it as context: their postings are rebuilt
--    from their own content, so nothing of a forgotten memory stays searchable.
-- Triggers run as the writing role inside its tenant transaction; memory_context has row-level security like
-- every tenant table.

CREATE TABLE memory_context (
    memory_id   uuid PRIMARY KEY REFERENCES memories (id) ON DELETE CASCADE,
    context_id  uuid NOT NULL REFERENCES memories (id) ON DELETE CASCADE,
    org_id      uuid NOT NULL,
    agent_id    uuid NOT NULL
);
CREATE INDEX memory_context_by_context ON memory_context (context_id);

ALTER TABLE memory_context ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_context FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON memory_context USING (org_id = ibex_current_org())
    WITH CHECK (org_id = ibex_current_org());
CREATE POLICY agent_isolation ON memory_context AS RESTRICTIVE
    USING (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent())
    WITH CHECK (ibex_current_agent() IS NULL OR agent_id = ibex_current_agent());
GRANT SELECT, INSERT, DELETE ON memory_context TO ibex_app;

-- The predecessor lookup: one index range per session, newest first.
CREATE INDEX memories_by_session ON memories
    (org_id, agent_id, session_id, (coalesce(observed_at, valid_from, created_at)) DESC)
    WHERE session_id IS NOT NULL AND status IN ('active', 'superseded');

-- The postings of one memory from its lexemes and, when given, its context's.
CREATE FUNCTION ibex_memory_terms_write(p_memory uuid, p_org uuid, p_agent uuid, p_tsv tsvector,
                                        p_context tsvector) RETURNS void
    LANGUAGE sql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        DELETE FROM public.memory_terms t WHERE t.memory_id = p_memory;
        INSERT INTO public.memory_terms (org_id, agent_id, lexeme, memory_id, tf, doc_len)
        SELECT p_org, p_agent, v.lexeme, p_memory, coalesce(array_length(v.positions, 1), 1),
               greatest(length(m.tsv), 1)
          FROM (SELECT coalesce(p_tsv, ''::tsvector) || coalesce(p_context, ''::tsvector) AS tsv) m
         CROSS JOIN LATERAL unnest(m.tsv) AS v;
    $$;

-- The context of a memory: the memory of its session observed last strictly before it (none without a session).
CREATE FUNCTION ibex_memory_context_of(p_memory uuid) RETURNS uuid
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        SELECT m.id
          FROM public.memories own
          JOIN public.memories m
            ON m.org_id = own.org_id AND m.agent_id = own.agent_id AND m.session_id = own.session_id
         WHERE own.id = p_memory
           AND m.status IN ('active', 'superseded') AND m.id <> own.id
           AND coalesce(m.observed_at, m.valid_from, m.created_at)
               < coalesce(own.observed_at, own.valid_from, own.created_at)
         ORDER BY coalesce(m.observed_at, m.valid_from, m.created_at) DESC, m.id DESC
         LIMIT 1
    $$;

CREATE FUNCTION ibex_memory_context_link() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    DECLARE
        own     public.memories%ROWTYPE;
        ctx     record;
    BEGIN
        -- At commit: the row as it is now (the same transaction may have superseded or forgotten it since).
        SELECT * INTO own FROM public.memories m WHERE m.id = NEW.id;
        IF NOT FOUND OR own.status <> 'active' OR own.session_id IS NULL THEN
            RETURN NULL;
        END IF;
        SELECT m.id, m.content_tsv INTO ctx
          FROM public.memories m WHERE m.id = public.ibex_memory_context_of(own.id);
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        INSERT INTO public.memory_context (memory_id, context_id, org_id, agent_id)
        VALUES (own.id, ctx.id, own.org_id, own.agent_id)
        ON CONFLICT (memory_id) DO NOTHING;
        IF FOUND THEN
            PERFORM public.ibex_memory_terms_write(own.id, own.org_id, own.agent_id, own.content_tsv,
                                                   ctx.content_tsv);
        END IF;
        RETURN NULL;
    END
    $$;

CREATE CONSTRAINT TRIGGER memories_context_link
    AFTER INSERT ON memories
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.session_id IS NOT NULL AND NEW.status = 'active')
    EXECUTE FUNCTION ibex_memory_context_link();

CREATE FUNCTION ibex_memory_context_forget() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    DECLARE
        dependant  record;
    BEGIN
        FOR dependant IN
            DELETE FROM public.memory_context c WHERE c.context_id = NEW.id RETURNING c.memory_id
        LOOP
            PERFORM public.ibex_memory_terms_write(m.id, m.org_id, m.agent_id, m.content_tsv, NULL)
               FROM public.memories m
              WHERE m.id = dependant.memory_id AND m.status = 'active';
        END LOOP;
        RETURN NULL;
    END
    $$;

CREATE TRIGGER memories_context_forget
    AFTER UPDATE OF status ON memories
    FOR EACH ROW WHEN (NEW.status = 'forgotten' AND OLD.status <> 'forgotten')
    EXECUTE FUNCTION ibex_memory_context_forget();

-- Memories written before this migration: link every active session memory to its context now.
WITH linked AS (
    INSERT INTO memory_context (memory_id, context_id, org_id, agent_id)
    SELECT m.id, c.id, m.org_id, m.agent_id
      FROM memories m
     CROSS JOIN LATERAL (SELECT ibex_memory_context_of(m.id) AS id) c
     WHERE m.status = 'active' AND m.session_id IS NOT NULL AND c.id IS NOT NULL
    RETURNING memory_id, context_id
)
SELECT ibex_memory_terms_write(m.id, m.org_id, m.agent_id, m.content_tsv, p.content_tsv)
  FROM linked l JOIN memories m ON m.id = l.memory_id JOIN memories p ON p.id = l.context_id;

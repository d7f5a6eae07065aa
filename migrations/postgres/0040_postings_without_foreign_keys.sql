-- 0040: the postings tables lose their foreign keys; a trigger on memories removes a deleted memory's postings.
--
-- Called by no code directly: memory_terms (0012) and memory_sparse_terms (0025) are written by the sync triggers of
-- memories, in the writing transaction, from the memory's own row. Each posting row carried a foreign key to
-- memories, so every insert of a memory checked it once per posting (a key-share lock on the memory row, about 80
-- per memory: its BM25 terms and its SPLADE tokens). Measured with EXPLAIN ANALYZE of single inserts as the
-- application role at 3,000 memories (69 SPLADE tokens per memory): the sparse trigger took 0.93-0.97 ms with the
-- keys and 0.57-0.60 without, the BM25 trigger 0.18-0.20 and 0.10-0.12; Postgres spends about 3.3-3.9 core-ms per
-- memory of a bulk ingest. The keys guarded nothing the triggers do not: a posting is written from the memory's row
-- and removed when the memory leaves 'active'.
--
-- What the keys' ON DELETE CASCADE did is kept: ibex_memory_postings_drop deletes the postings of the memories a
-- DELETE removed, once per statement from its transition table (the tenant purge deletes each table by org or
-- agent anyway, and nothing else deletes memories). It runs as the caller, as the sync triggers do, so row-level
-- security scopes it like the DELETE that fired it.

ALTER TABLE memory_terms DROP CONSTRAINT memory_terms_memory_id_fkey;
ALTER TABLE memory_sparse_terms DROP CONSTRAINT memory_sparse_terms_memory_id_fkey;

CREATE FUNCTION ibex_memory_postings_drop() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        DELETE FROM public.memory_terms t USING gone g WHERE t.memory_id = g.id;
        DELETE FROM public.memory_sparse_terms t USING gone g WHERE t.memory_id = g.id;
        RETURN NULL;
    END
    $$;

CREATE TRIGGER memories_postings_drop
    AFTER DELETE ON memories
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION ibex_memory_postings_drop();

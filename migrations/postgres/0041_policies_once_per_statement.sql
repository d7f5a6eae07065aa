-- 0041: the row-level security policies read the tenant once per statement, not once per row.
--
-- Called by no code: every tenant table's policies (tenant_isolation of 0001 and the tables added since, and the
-- RESTRICTIVE agent_isolation) compared each row with ibex_current_org() / ibex_current_agent(). Postgres inlines
-- those SQL functions into nullif(current_setting(...), '')::uuid, and where a statement's own predicates do not
-- let the planner fold the comparison into a one-time filter it evaluates that expression for every row the scan
-- returns: in agent_isolation always (the OR keeps it a per-row filter), in tenant_isolation when the statement
-- reaches rows by something other than org_id. Measured as the application role at 10,000 memories of one agent:
-- the text leg's population count (0038; up to 20,000 rows, inline in a search once a minute per agent) took
-- 6.0-7.0 ms, 1.4-1.9 ms with the policies below; a scan of 5,961 postings 5.1 ms, against 0.7 ms for the same
-- scan without row-level security.
--
-- Each policy now compares with a scalar subquery, (SELECT ibex_current_org()), which the planner turns into an
-- initplan: computed once when the statement first needs it, then a parameter for every row. The rows each policy
-- admits are the same (no tenant set: NULL, so no row; an agent set: only its rows), and the value cannot go stale
-- within a statement, since nothing sets app.org_id or app.agent_id in the middle of one (the *_as functions set
-- the tenant in a statement of its own before their query). A table added later must write its policies in this
-- form; tests/integration/test_rls.py checks every policy of the schema.
--
-- The policies are rewritten from the catalog, each checked against the form it was created with, so that a
-- policy this migration does not know stops the upgrade instead of being left as it was.

DO $$
DECLARE
    p record;
    org_policy constant text := '(SELECT ibex_current_org())';
    agent_policy constant text :=
        '(SELECT ibex_current_agent()) IS NULL OR agent_id = (SELECT ibex_current_agent())';
    expr text;
BEGIN
    FOR p IN SELECT tablename, policyname, qual, with_check FROM pg_policies WHERE schemaname = 'public'
    LOOP
        IF p.with_check IS DISTINCT FROM p.qual THEN
            RAISE EXCEPTION 'policy % on % checks writes differently from reads', p.policyname, p.tablename;
        END IF;
        expr := CASE
            WHEN p.policyname = 'tenant_isolation' AND p.qual = '(org_id = ibex_current_org())'
                THEN 'org_id = ' || org_policy
            WHEN p.policyname = 'tenant_isolation' AND p.qual = '(id = ibex_current_org())'
                THEN 'id = ' || org_policy
            WHEN p.policyname = 'agent_isolation'
                 AND p.qual = '((ibex_current_agent() IS NULL) OR (agent_id = ibex_current_agent()))'
                THEN agent_policy
        END;
        IF expr IS NULL THEN
            RAISE EXCEPTION 'policy % on % is not one this migration rewrites: %', p.policyname, p.tablename, p.qual;
        END IF;
        EXECUTE format('ALTER POLICY %I ON public.%I USING (%s) WITH CHECK (%s)',
                       p.policyname, p.tablename, expr, expr);
    END LOOP;
END
$$;

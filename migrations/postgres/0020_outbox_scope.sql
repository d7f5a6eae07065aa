-- 0020: the outbox lease reveals no tenant data. The data-plane role leases due events of every org (a worker
-- must find work before it knows whose it is), but only their ids and owners; it reads each event's payload
-- inside that org's own row-level-security scope.

DROP FUNCTION ibex_outbox_lease(text[], integer, interval);

CREATE FUNCTION ibex_outbox_lease_ids(p_kinds text[], p_limit integer, p_lease interval)
    RETURNS TABLE (id bigint, org_id uuid, agent_id uuid, kind text, attempts integer)
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH due AS (
            SELECT o.id
              FROM public.outbox o
             WHERE o.done_at IS NULL AND o.available_at <= now() AND o.kind = ANY (p_kinds)
             ORDER BY o.available_at, o.id
             LIMIT greatest(p_limit, 0)
               FOR UPDATE SKIP LOCKED
        )
        UPDATE public.outbox o
           SET available_at = now() + p_lease, attempts = o.attempts + 1
          FROM due
         WHERE o.id = due.id
        RETURNING o.id, o.org_id, o.agent_id, o.kind, o.attempts
    $$;

REVOKE ALL ON FUNCTION ibex_outbox_lease_ids(text[], integer, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_outbox_lease_ids(text[], integer, interval) TO ibex_app;

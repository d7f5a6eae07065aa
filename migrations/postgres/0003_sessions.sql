-- 0003: the idle-session sweeper. The data plane's role sees no rows without an org, so the cross-tenant sweep
-- is a narrow SECURITY DEFINER function: it can only close sessions that have been idle for longer than asked.

CREATE FUNCTION ibex_sweep_idle_sessions(p_idle interval, p_limit integer DEFAULT 1000) RETURNS integer
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        WITH idle AS (
            SELECT id FROM sessions
             WHERE status = 'active' AND last_activity_at < now() - p_idle
             ORDER BY last_activity_at
             LIMIT p_limit
             FOR UPDATE SKIP LOCKED
        ), closed AS (
            UPDATE sessions s SET status = 'closed', closed_at = now(), close_reason = 'idle'
              FROM idle WHERE s.id = idle.id
            RETURNING 1
        )
        SELECT count(*)::integer FROM closed
    $$;
REVOKE ALL ON FUNCTION ibex_sweep_idle_sessions(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_sweep_idle_sessions(interval, integer) TO ibex_app;

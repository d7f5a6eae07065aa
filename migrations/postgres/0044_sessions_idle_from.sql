-- 0044: a session's next turn rewrites no index entry. Every turn moves the session's last_activity_at, and the
-- idle sweeper's index was on that column, so each turn's update of the row was a new version with a new entry in
-- each of the table's three indexes (never HOT), for a column that only the sweeper reads, against idle times of
-- many minutes.
--
-- The sweeper's index is now on idle_from: last_activity_at as it was up to a minute ago. A trigger keeps it: a
-- turn within a minute of idle_from leaves it alone (the update changes no indexed column and can stay on its
-- page); a turn a minute or more after it, or any write that moves last_activity_at backwards, sets it to
-- last_activity_at again. So idle_from <= last_activity_at < idle_from + 1 minute, always, and the sweeper selects
-- by idle_from through the index, then checks last_activity_at itself: it closes exactly the sessions it closed
-- before.

-- The old index goes first: filling the new column in then has one index less to maintain.
DROP INDEX sessions_idle;
ALTER TABLE sessions ADD COLUMN idle_from timestamptz;
UPDATE sessions SET idle_from = last_activity_at;
ALTER TABLE sessions ALTER COLUMN idle_from SET DEFAULT now(), ALTER COLUMN idle_from SET NOT NULL;

CREATE FUNCTION ibex_sessions_idle_from() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.last_activity_at >= OLD.idle_from
       AND NEW.last_activity_at < OLD.idle_from + interval '1 minute' THEN
        NEW.idle_from := OLD.idle_from;
    ELSE
        NEW.idle_from := NEW.last_activity_at;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER sessions_idle_from BEFORE INSERT OR UPDATE OF last_activity_at, idle_from ON sessions
    FOR EACH ROW EXECUTE FUNCTION ibex_sessions_idle_from();

CREATE INDEX sessions_idle_from ON sessions (idle_from) WHERE status = 'active';

-- Room on each page for the turns' new row versions (HOT needs the new version on the same page).
ALTER TABLE sessions SET (fillfactor = 85);

CREATE OR REPLACE FUNCTION ibex_sweep_idle_sessions(p_idle interval, p_limit integer DEFAULT 1000) RETURNS integer
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
        WITH idle AS (
            SELECT id FROM sessions
             WHERE status = 'active' AND idle_from < now() - p_idle AND last_activity_at < now() - p_idle
             ORDER BY idle_from
             LIMIT p_limit
             FOR UPDATE SKIP LOCKED
        ), closed AS (
            UPDATE sessions s SET status = 'closed', closed_at = now(), close_reason = 'idle'
              FROM idle WHERE s.id = idle.id
            RETURNING 1
        )
        SELECT count(*)::integer FROM closed
    $$;

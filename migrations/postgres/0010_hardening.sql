-- 0010: SECURITY DEFINER functions search pg_temp last, so a temporary object can never shadow what they call.

ALTER FUNCTION ibex_lookup_api_key(text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION ibex_sweep_idle_sessions(interval, integer) SET search_path = pg_catalog, public, pg_temp;

-- 0009: one-round-trip entry points for the proxy's hot path (used through Database.call_as).
--
-- Each *_as function takes the tenant as its first two arguments, sets app.org_id / app.agent_id for the current
-- transaction exactly as Database.tenant does, then does its work as the caller (SECURITY INVOKER): row-level
-- security applies to every row it touches. A single statement is its own transaction, so the hot path pays one
-- round trip instead of BEGIN + scope, statement, COMMIT.

CREATE FUNCTION ibex_set_tenant(p_org uuid, p_agent uuid) RETURNS void
    LANGUAGE sql VOLATILE
    AS $$
        SELECT set_config('app.org_id', p_org::text, true),
               set_config('app.agent_id', coalesce(p_agent::text, ''), true)
    $$;

CREATE FUNCTION ibex_budget_hold_as(
    p_org uuid, p_agent uuid, p_hold_id uuid, p_request_id text, p_period_start date, p_amount numeric,
    p_org_limit numeric, p_agent_limit numeric, p_enforcement text, p_ttl interval,
    OUT outcome text, OUT scope text, OUT scope_limit numeric, OUT scope_spent numeric, OUT scope_held numeric)
    LANGUAGE plpgsql VOLATILE
    AS $$
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    SELECT h.outcome, h.scope, h.scope_limit, h.scope_spent, h.scope_held
      INTO outcome, scope, scope_limit, scope_spent, scope_held
      FROM ibex_budget_hold(p_hold_id, p_agent, p_request_id, p_period_start, p_amount, p_org_limit,
                            p_agent_limit, p_enforcement, p_ttl) h;
END
$$;

CREATE FUNCTION ibex_budget_settle_as(
    p_org uuid, p_agent uuid, p_hold_id uuid, p_actual numeric, p_model text, p_prompt_tokens integer,
    p_completion_tokens integer) RETURNS text
    LANGUAGE plpgsql VOLATILE
    AS $$
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    RETURN ibex_budget_settle(p_hold_id, p_actual, p_model, p_prompt_tokens, p_completion_tokens);
END
$$;

CREATE FUNCTION ibex_budget_release_as(p_org uuid, p_agent uuid, p_hold_id uuid) RETURNS text
    LANGUAGE plpgsql VOLATILE
    AS $$
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    RETURN ibex_budget_release(p_hold_id);
END
$$;

-- A session turn: open (or reopen) the session and append its checkpoint. Returns the turn number.
CREATE FUNCTION ibex_session_turn_as(
    p_org uuid, p_agent uuid, p_external_id text, p_request_id text, p_messages text[], p_completion text,
    p_prompt_tokens integer, p_completion_tokens integer, p_latency_ms real) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_session uuid;
    v_turn    integer;
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    INSERT INTO sessions (org_id, agent_id, external_id, turn_count)
    VALUES (p_org, p_agent, p_external_id, 1)
    ON CONFLICT (org_id, agent_id, external_id) DO UPDATE SET
        turn_count = sessions.turn_count + 1, last_activity_at = now(),
        status = 'active', closed_at = NULL, close_reason = NULL
    RETURNING id, turn_count INTO v_session, v_turn;
    INSERT INTO session_checkpoints (session_id, turn, org_id, agent_id, request_id, messages_sha256,
        completion_sha256, prompt_tokens, completion_tokens, latency_ms)
    VALUES (v_session, v_turn, p_org, p_agent, p_request_id, p_messages, p_completion, p_prompt_tokens,
            p_completion_tokens, p_latency_ms)
    ON CONFLICT DO NOTHING;
    RETURN v_turn;
END
$$;

GRANT EXECUTE ON FUNCTION ibex_set_tenant(uuid, uuid),
    ibex_budget_hold_as(uuid, uuid, uuid, text, date, numeric, numeric, numeric, text, interval),
    ibex_budget_settle_as(uuid, uuid, uuid, numeric, text, integer, integer),
    ibex_budget_release_as(uuid, uuid, uuid),
    ibex_session_turn_as(uuid, uuid, text, text, text[], text, integer, integer, real)
    TO ibex_app;

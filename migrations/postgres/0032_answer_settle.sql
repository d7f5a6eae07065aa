-- 0032: after a served answer the proxy settles its budget hold and checkpoints the session in one statement, so
-- one transaction and one commit (one WAL flush with synchronous_commit on) instead of two. Called by
-- ibex_dataplane.proxy.sessions.
--
-- Money first: the checkpoint (and its capture job) runs in a subtransaction of its own, so a checkpoint that fails
-- never undoes the settle; the function then returns the failure's SQLSTATE instead of a turn.

CREATE FUNCTION ibex_answer_settle_as(
    p_org uuid, p_agent uuid, p_hold_id uuid, p_actual numeric, p_model text, p_prompt_tokens integer,
    p_completion_tokens integer, p_external_id text, p_request_id text, p_messages text[], p_completion text,
    p_latency_ms real, p_mode text, p_capture_model text, p_capture jsonb, p_observed_at timestamptz,
    p_ttl interval, OUT hold_status text, OUT turn integer, OUT checkpoint_error text)
    LANGUAGE plpgsql VOLATILE
    AS $$
BEGIN
    hold_status := ibex_budget_settle_as(p_org, p_agent, p_hold_id, p_actual, p_model, p_prompt_tokens,
                                         p_completion_tokens);
    BEGIN
        turn := ibex_session_turn_capture_as(p_org, p_agent, p_external_id, p_request_id, p_messages, p_completion,
                                             p_prompt_tokens, p_completion_tokens, p_latency_ms, p_mode,
                                             p_capture_model, p_capture, p_observed_at, p_ttl);
    EXCEPTION WHEN OTHERS THEN
        checkpoint_error := SQLSTATE;  -- the code only: a message could quote tenant data into a log line
    END;
END
$$;

GRANT EXECUTE ON FUNCTION ibex_answer_settle_as(uuid, uuid, uuid, numeric, text, integer, integer, text, text,
    text[], text, real, text, text, jsonb, timestamptz, interval) TO ibex_app;

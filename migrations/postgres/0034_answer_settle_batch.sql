-- 0034: the answers of one agent settled and checkpointed together, in one statement. Under load the proxy's
-- settles arrive faster than one statement each can commit, and each one took the agent's and the org's budget
-- rows for its own commit, so every hold queued behind them. Now one statement per agent is in flight at a time
-- (ibex_dataplane.proxy.settles gathers what arrives meanwhile); it settles each hold and checkpoints each turn in
-- order, then moves every budget row once by the batch's sums, so those rows are locked only from that last
-- update to the commit, once per batch.
--
-- ibex_budget_settle keeps one definition of what settling a hold means: both it and the batch call
-- ibex_budget_settle_hold (the hold and the ledger) and differ only in when the budget rows move.
--
-- Money first, as in 0032: each checkpoint (and its capture job) runs in a subtransaction of its own, so a
-- checkpoint that fails never undoes a settle; its row then carries the SQLSTATE instead of a turn.

-- Settle one hold of the current org without touching budget_periods: lock it, write its ledger row, mark it
-- settled. Returns the status before (NULL: no such hold), and what the caller must take out of held_usd and add
-- to spent_usd on the hold's org and agent rows of its period.
CREATE FUNCTION ibex_budget_settle_hold(
    p_hold_id uuid, p_actual numeric, p_model text, p_prompt_tokens integer, p_completion_tokens integer,
    OUT status text, OUT agent_id uuid, OUT period_start date, OUT release_usd numeric, OUT spend_usd numeric)
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_hold      budget_holds%ROWTYPE;
    v_actual    numeric(18, 8) := p_actual;
BEGIN
    SELECT * INTO v_hold FROM budget_holds h WHERE h.id = p_hold_id AND h.org_id = ibex_current_org() FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    status := v_hold.status;
    agent_id := v_hold.agent_id;
    period_start := v_hold.period_start;
    release_usd := 0;
    spend_usd := 0;
    IF v_hold.status = 'settled' THEN
        RETURN;
    END IF;

    INSERT INTO budget_ledger (org_id, agent_id, request_id, model, prompt_tokens, completion_tokens, cost_usd)
    VALUES (v_hold.org_id, v_hold.agent_id, v_hold.request_id, p_model, p_prompt_tokens, p_completion_tokens,
            v_actual)
    ON CONFLICT (org_id, request_id) DO NOTHING;
    spend_usd := CASE WHEN FOUND THEN v_actual ELSE 0 END;
    -- An expired or released hold was already taken out of held_usd.
    release_usd := CASE WHEN v_hold.status = 'held' THEN v_hold.amount_usd ELSE 0 END;

    UPDATE budget_holds h
       SET status = 'settled', actual_usd = v_actual, settled_at = now()
     WHERE h.id = p_hold_id;
END
$$;

CREATE OR REPLACE FUNCTION ibex_budget_settle(
    p_hold_id           uuid,
    p_actual            numeric,
    p_model             text,
    p_prompt_tokens     integer,
    p_completion_tokens integer)
    RETURNS text
    LANGUAGE plpgsql
    AS $$
DECLARE
    v   record;
BEGIN
    SELECT * INTO v FROM ibex_budget_settle_hold(p_hold_id, p_actual, p_model, p_prompt_tokens, p_completion_tokens);
    IF v.status IS NULL OR v.status = 'settled' THEN
        RETURN v.status;
    END IF;
    -- The budget rows last: from here to COMMIT, holds on these scopes wait. Org row first, then the agent's.
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v.release_usd, spent_usd = b.spent_usd + v.spend_usd, updated_at = now()
     WHERE b.org_id = ibex_current_org() AND b.scope_id = ibex_current_org() AND b.period_start = v.period_start;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v.release_usd, spent_usd = b.spent_usd + v.spend_usd, updated_at = now()
     WHERE b.org_id = ibex_current_org() AND b.scope_id = v.agent_id AND b.period_start = v.period_start;
    RETURN v.status;
END
$$;

-- p_items: a JSON array, one object per answer, in the order they were answered:
--   {"hold": uuid, "actual": "decimal as text", "model": text, "prompt_tokens": int, "completion_tokens": int,
--    "session": text, "request_id": text, "messages": [sha256 hex...], "completion": text or null,
--    "latency_ms": number, "mode": text or null, "capture_model": text or null, "capture": json or null,
--    "observed_at": timestamptz as text or null}
-- One row per item, in that order.
CREATE FUNCTION ibex_answer_settle_batch_as(p_org uuid, p_agent uuid, p_items jsonb, p_ttl interval)
    RETURNS TABLE (hold_status text, turn integer, checkpoint_error text)
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_item      jsonb;
    v           record;
    v_agents    uuid[] := '{}';
    v_periods   date[] := '{}';
    v_releases  numeric[] := '{}';
    v_spends    numeric[] := '{}';
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    FOR v_item IN SELECT value FROM jsonb_array_elements(p_items) LOOP
        SELECT * INTO v FROM ibex_budget_settle_hold(
            (v_item->>'hold')::uuid, (v_item->>'actual')::numeric, v_item->>'model',
            (v_item->>'prompt_tokens')::integer, (v_item->>'completion_tokens')::integer);
        hold_status := v.status;
        IF v.status IS NOT NULL AND v.status <> 'settled' THEN
            v_agents := v_agents || v.agent_id;
            v_periods := v_periods || v.period_start;
            v_releases := v_releases || v.release_usd;
            v_spends := v_spends || v.spend_usd;
        END IF;
        turn := NULL;
        checkpoint_error := NULL;
        BEGIN
            turn := ibex_session_turn_capture_as(
                p_org, p_agent, v_item->>'session', v_item->>'request_id',
                ARRAY(SELECT jsonb_array_elements_text(v_item->'messages')), v_item->>'completion',
                (v_item->>'prompt_tokens')::integer, (v_item->>'completion_tokens')::integer,
                (v_item->>'latency_ms')::real, v_item->>'mode', v_item->>'capture_model',
                CASE WHEN jsonb_typeof(v_item->'capture') IN ('array', 'object') THEN v_item->'capture' END,
                (v_item->>'observed_at')::timestamptz, p_ttl);
        EXCEPTION WHEN OTHERS THEN
            checkpoint_error := SQLSTATE;  -- the code only: a message could quote tenant data into a log line
        END;
        RETURN NEXT;
    END LOOP;

    -- The budget rows last, each moved once by the batch's sums: org rows first, then the agents', as holds take
    -- them.
    UPDATE budget_periods b
       SET held_usd = b.held_usd - s.release_usd, spent_usd = b.spent_usd + s.spend_usd, updated_at = now()
      FROM (SELECT u.period_start, sum(u.release_usd) AS release_usd, sum(u.spend_usd) AS spend_usd
              FROM unnest(v_periods, v_releases, v_spends) AS u(period_start, release_usd, spend_usd)
             GROUP BY u.period_start) s
     WHERE b.org_id = p_org AND b.scope_id = p_org AND b.period_start = s.period_start;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - s.release_usd, spent_usd = b.spent_usd + s.spend_usd, updated_at = now()
      FROM (SELECT u.agent_id, u.period_start, sum(u.release_usd) AS release_usd, sum(u.spend_usd) AS spend_usd
              FROM unnest(v_agents, v_periods, v_releases, v_spends)
                   AS u(agent_id, period_start, release_usd, spend_usd)
             GROUP BY u.agent_id, u.period_start) s
     WHERE b.org_id = p_org AND b.scope_id = s.agent_id AND b.period_start = s.period_start;
END
$$;

GRANT EXECUTE ON FUNCTION ibex_budget_settle_hold(uuid, numeric, text, integer, integer),
    ibex_answer_settle_batch_as(uuid, uuid, jsonb, interval) TO ibex_app;

-- Replaced by the batch (a batch of one is the single answer).
DROP FUNCTION ibex_answer_settle_as(uuid, uuid, uuid, numeric, text, integer, integer, text, text, text[], text,
    real, text, text, jsonb, timestamptz, interval);

-- 0035: budget leases (docs/budget-leases.md). A lease is an ordinary budget_holds row whose request_id starts
-- with 'lease_': one durable hold for the worst case of many requests of one agent, which a proxy process then
-- draws from in memory. Each drawn request is settled alone, by its own request id, and takes its drawn amount out
-- of the lease (so out of held_usd). The lease's remainder goes back with ibex_budget_release_as, or through the
-- sweeper when its process died. So the invariants of 0002 hold as they were: spent_usd is the sum of the period's
-- ledger rows, held_usd the sum of the amounts of its 'held' holds.
--
-- Lock order as in 0002: the budget_holds row first, then the org's budget_periods row, then the agent's.

-- Place a lease for an agent of p_org. Returns 'held', or 'refused' (nothing held anywhere) when some limited
-- scope would not keep p_reserve free beside the lease: a lease never goes over a limit, whatever the
-- enforcement, and never takes the last of a budget.
CREATE FUNCTION ibex_budget_lease_as(
    p_org uuid, p_agent uuid, p_lease_id uuid, p_period_start date, p_amount numeric, p_reserve numeric,
    p_org_limit numeric, p_agent_limit numeric, p_enforcement text, p_ttl interval) RETURNS text
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_amount    numeric(18, 8) := p_amount;
    v_need      numeric := p_amount + p_reserve;
    v_org_spent numeric;
    v_org_held  numeric;
    v_ag_spent  numeric;
    v_ag_held   numeric;
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    IF v_amount IS NULL OR v_amount <= 0 OR p_reserve IS NULL OR p_reserve < 0 THEN
        RAISE EXCEPTION 'a lease needs a positive amount and a reserve >= 0' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Refuse on committed totals without locking anything when they already leave no room (exact, as in 0002).
    PERFORM 1 FROM budget_periods b
     WHERE b.org_id = p_org AND b.scope_id IN (p_org, p_agent) AND b.period_start = p_period_start
       AND b.spent_usd + b.held_usd + v_need
           > CASE WHEN b.scope_kind = 'org' THEN p_org_limit ELSE p_agent_limit END;
    IF FOUND THEN
        RETURN 'refused';
    END IF;

    INSERT INTO budget_holds (id, org_id, agent_id, request_id, period_start, amount_usd, status, expires_at)
    VALUES (p_lease_id, p_org, p_agent, 'lease_' || replace(p_lease_id::text, '-', ''), p_period_start, v_amount,
            'held', now() + p_ttl);
    SELECT s.spent, s.held INTO v_org_spent, v_org_held
      FROM ibex_budget_lock_scope('org', p_org, p_period_start, p_org_limit, p_enforcement) s;
    SELECT s.spent, s.held INTO v_ag_spent, v_ag_held
      FROM ibex_budget_lock_scope('agent', p_agent, p_period_start, p_agent_limit, p_enforcement) s;
    IF (p_org_limit IS NOT NULL AND v_org_spent + v_org_held + v_need > p_org_limit)
       OR (p_agent_limit IS NOT NULL AND v_ag_spent + v_ag_held + v_need > p_agent_limit) THEN
        DELETE FROM budget_holds h WHERE h.id = p_lease_id;
        RETURN 'refused';
    END IF;
    UPDATE budget_periods b
       SET held_usd = b.held_usd + v_amount,
           limit_usd = CASE WHEN b.scope_kind = 'org' THEN p_org_limit ELSE p_agent_limit END,
           enforcement = p_enforcement,
           updated_at = now()
     WHERE b.org_id = p_org AND b.scope_id IN (p_org, p_agent) AND b.period_start = p_period_start;
    RETURN 'held';
END
$$;

-- Settle one request drawn from a lease of the current org, without touching budget_periods (the shape of
-- ibex_budget_settle_hold, so the batch sums both alike). Idempotent by the request id: when its ledger row exists
-- already nothing moves and the status is 'settled'. Otherwise the status is the lease's ('held', or 'expired' /
-- 'released' for a late settle, which adds spend only). NULL: no such lease.
CREATE FUNCTION ibex_budget_settle_draw(
    p_lease_id uuid, p_request_id text, p_drawn numeric, p_actual numeric, p_model text, p_prompt_tokens integer,
    p_completion_tokens integer,
    OUT status text, OUT agent_id uuid, OUT period_start date, OUT release_usd numeric, OUT spend_usd numeric)
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_lease     budget_holds%ROWTYPE;
    v_actual    numeric(18, 8) := p_actual;
BEGIN
    IF p_drawn IS NULL OR p_drawn < 0 OR p_request_id IS NULL OR p_request_id LIKE 'lease\_%' THEN
        RAISE EXCEPTION 'a draw needs its request id and an amount >= 0' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO v_lease FROM budget_holds h
     WHERE h.id = p_lease_id AND h.org_id = ibex_current_org() AND h.request_id LIKE 'lease\_%'
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    agent_id := v_lease.agent_id;
    period_start := v_lease.period_start;
    release_usd := 0;
    spend_usd := 0;
    INSERT INTO budget_ledger (org_id, agent_id, request_id, model, prompt_tokens, completion_tokens, cost_usd)
    VALUES (v_lease.org_id, v_lease.agent_id, p_request_id, p_model, p_prompt_tokens, p_completion_tokens, v_actual)
    ON CONFLICT (org_id, request_id) DO NOTHING;
    IF NOT FOUND THEN
        status := 'settled';
        RETURN;
    END IF;
    status := v_lease.status;
    spend_usd := v_actual;
    IF v_lease.status = 'held' THEN  -- an expired or released lease was already taken out of held_usd
        release_usd := least(p_drawn, v_lease.amount_usd);
    END IF;
    UPDATE budget_holds h
       SET amount_usd = h.amount_usd - release_usd, actual_usd = coalesce(h.actual_usd, 0) + v_actual
     WHERE h.id = p_lease_id;
END
$$;

-- One draw settled alone (a settle retried after its batch failed), budget rows included.
CREATE FUNCTION ibex_budget_settle_draw_as(
    p_org uuid, p_agent uuid, p_lease_id uuid, p_request_id text, p_drawn numeric, p_actual numeric, p_model text,
    p_prompt_tokens integer, p_completion_tokens integer) RETURNS text
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v   record;
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    SELECT * INTO v FROM ibex_budget_settle_draw(p_lease_id, p_request_id, p_drawn, p_actual, p_model,
                                                 p_prompt_tokens, p_completion_tokens);
    IF v.status IS NULL OR v.status = 'settled' THEN
        RETURN v.status;
    END IF;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v.release_usd, spent_usd = b.spent_usd + v.spend_usd, updated_at = now()
     WHERE b.org_id = p_org AND b.scope_id = p_org AND b.period_start = v.period_start;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v.release_usd, spent_usd = b.spent_usd + v.spend_usd, updated_at = now()
     WHERE b.org_id = p_org AND b.scope_id = v.agent_id AND b.period_start = v.period_start;
    RETURN v.status;
END
$$;

-- The batch of 0034, with one change: an item carrying "drawn" (a decimal as text) was drawn from the lease
-- "hold" and is settled by its request id.
CREATE OR REPLACE FUNCTION ibex_answer_settle_batch_as(p_org uuid, p_agent uuid, p_items jsonb, p_ttl interval)
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
        IF v_item ? 'drawn' THEN
            SELECT * INTO v FROM ibex_budget_settle_draw(
                (v_item->>'hold')::uuid, v_item->>'request_id', (v_item->>'drawn')::numeric,
                (v_item->>'actual')::numeric, v_item->>'model', (v_item->>'prompt_tokens')::integer,
                (v_item->>'completion_tokens')::integer);
        ELSE
            SELECT * INTO v FROM ibex_budget_settle_hold(
                (v_item->>'hold')::uuid, (v_item->>'actual')::numeric, v_item->>'model',
                (v_item->>'prompt_tokens')::integer, (v_item->>'completion_tokens')::integer);
        END IF;
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

REVOKE ALL ON FUNCTION ibex_budget_lease_as(uuid, uuid, uuid, date, numeric, numeric, numeric, numeric, text,
    interval),
    ibex_budget_settle_draw(uuid, text, numeric, numeric, text, integer, integer),
    ibex_budget_settle_draw_as(uuid, uuid, uuid, text, numeric, numeric, text, integer, integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_budget_lease_as(uuid, uuid, uuid, date, numeric, numeric, numeric, numeric, text,
    interval),
    ibex_budget_settle_draw(uuid, text, numeric, numeric, text, integer, integer),
    ibex_budget_settle_draw_as(uuid, uuid, uuid, text, numeric, numeric, text, integer, integer)
    TO ibex_app;

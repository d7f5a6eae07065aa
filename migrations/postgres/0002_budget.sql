-- 0002: budget holds in one round trip each, and the sweeper that expires the holds of crashed requests.
--
-- Called by ibex_dataplane.proxy.budget_repository (and nothing else). The hold, settle and release functions run
-- as the caller (SECURITY INVOKER): row-level security applies to every statement in them and the org is always
-- ibex_current_org(), the app.org_id that Database.tenant set for the transaction. No parameter names an org.
-- Only the sweeper is SECURITY DEFINER: it must see every tenant's expired holds, and it can do nothing else.
--
-- Accounting, per scope (the org, and each agent) per calendar month (UTC):
--   hold:    held += amount                      (HardCap: only if spent + held + amount <= limit, for every scope)
--   settle:  held -= amount (if still held), spent += actual, one budget_ledger row
--   release: held -= amount                      (only if still held)
--   sweep:   held -= amount, hold 'expired'      (a late settle then adds spent only)
-- So spent_usd is always the sum of the period's ledger rows, and held_usd the sum of its 'held' holds.
--
-- Lock order, to rule out deadlocks: a budget_holds row before any budget_periods row; within one org and period
-- the org's budget_periods row before any agent's; the sweeper, the only statement that spans orgs and periods,
-- takes period rows ordered by (org_id, period_start, org row first, scope_id).

-- Lock one scope's row for this org and period (creating it on first use) and return its running totals.
CREATE FUNCTION ibex_budget_lock_scope(
    p_scope_kind    text,
    p_scope_id      uuid,
    p_period_start  date,
    p_limit         numeric,
    p_enforcement   text,
    OUT spent       numeric,
    OUT held        numeric)
    LANGUAGE plpgsql
    AS $$
BEGIN
    LOOP
        -- The common case is an existing row: lock it without attempting an insert first.
        SELECT b.spent_usd, b.held_usd INTO spent, held
          FROM budget_periods b
         WHERE b.org_id = ibex_current_org() AND b.scope_id = p_scope_id AND b.period_start = p_period_start
           FOR UPDATE;
        EXIT WHEN FOUND;
        -- A concurrent first use waits here for the other insert, then finds its row on the next turn.
        INSERT INTO budget_periods (org_id, scope_kind, scope_id, period_start, limit_usd, enforcement)
        VALUES (ibex_current_org(), p_scope_kind, p_scope_id, p_period_start, p_limit, p_enforcement)
        ON CONFLICT (org_id, scope_id, period_start) DO NOTHING;
    END LOOP;
END
$$;

-- Place a hold for one request of one agent of the current org. One call, one round trip.
--   outcome 'held':        held on both scopes, within every limit
--   outcome 'over_budget': AlertOnly and some scope went over its limit: held anyway (scope_* describe it)
--   outcome 'refused':     HardCap and some scope would go over: nothing held anywhere (scope_* describe it)
--   outcome 'duplicate':   this org already has a hold for the request id: nothing held
-- Every call also records the newest limit and enforcement on both scope rows.
CREATE FUNCTION ibex_budget_hold(
    p_hold_id       uuid,
    p_agent_id      uuid,
    p_request_id    text,
    p_period_start  date,
    p_amount        numeric,
    p_org_limit     numeric,
    p_agent_limit   numeric,
    p_enforcement   text,
    p_ttl           interval,
    OUT outcome     text,
    OUT scope       text,
    OUT scope_limit numeric,
    OUT scope_spent numeric,
    OUT scope_held  numeric)
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_org           uuid := ibex_current_org();
    v_amount        numeric(18, 8) := p_amount;
    v_org_spent     numeric;
    v_org_held      numeric;
    v_agent_spent   numeric;
    v_agent_held    numeric;
BEGIN
    IF v_org IS NULL THEN
        RAISE EXCEPTION 'budget hold outside a tenant transaction' USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF v_amount IS NULL OR v_amount < 0 THEN
        RAISE EXCEPTION 'hold amount must be >= 0' USING ERRCODE = 'invalid_parameter_value';
    END IF;

    -- 1. A HardCap whose committed totals already leave no room refuses without locking or writing anything, so
    --    a client retrying against an exhausted budget never queues in front of holds that would fit. Refusing
    --    on committed totals is exact: they were the state of the budget at that instant.
    IF p_enforcement = 'HardCap' THEN
        SELECT b.scope_kind, l.value, b.spent_usd, b.held_usd
          INTO scope, scope_limit, scope_spent, scope_held
          FROM budget_periods b
         CROSS JOIN LATERAL (SELECT CASE WHEN b.scope_kind = 'org' THEN p_org_limit ELSE p_agent_limit END) l (value)
         WHERE b.org_id = v_org AND b.scope_id IN (v_org, p_agent_id) AND b.period_start = p_period_start
           AND b.spent_usd + b.held_usd + v_amount > l.value
         ORDER BY b.scope_kind DESC  -- 'org' before 'agent'
         LIMIT 1;
    END IF;

    IF scope IS NULL THEN
        -- 2. The hold row before the budget locks: it is the costliest write (three indexes and the agent's
        --    foreign key), and the unique (org_id, request_id) makes a repeated request id wait for the first.
        INSERT INTO budget_holds (id, org_id, agent_id, request_id, period_start, amount_usd, status, expires_at)
        VALUES (p_hold_id, v_org, p_agent_id, p_request_id, p_period_start, v_amount, 'held', now() + p_ttl)
        ON CONFLICT (org_id, request_id) DO NOTHING;
        IF NOT FOUND THEN
            outcome := 'duplicate';
            RETURN;
        END IF;

        -- 3. Lock the org's row, then the agent's. From here to COMMIT other holds on these scopes wait.
        SELECT s.spent, s.held INTO v_org_spent, v_org_held
          FROM ibex_budget_lock_scope('org', v_org, p_period_start, p_org_limit, p_enforcement) s;
        SELECT s.spent, s.held INTO v_agent_spent, v_agent_held
          FROM ibex_budget_lock_scope('agent', p_agent_id, p_period_start, p_agent_limit, p_enforcement) s;
        IF p_org_limit IS NOT NULL AND v_org_spent + v_org_held + v_amount > p_org_limit THEN
            scope := 'org';
            scope_limit := p_org_limit;
            scope_spent := v_org_spent;
            scope_held := v_org_held;
        ELSIF p_agent_limit IS NOT NULL AND v_agent_spent + v_agent_held + v_amount > p_agent_limit THEN
            scope := 'agent';
            scope_limit := p_agent_limit;
            scope_spent := v_agent_spent;
            scope_held := v_agent_held;
        END IF;
    END IF;

    IF scope IS NULL THEN
        outcome := 'held';
    ELSIF p_enforcement = 'AlertOnly' THEN
        outcome := 'over_budget';
    ELSE
        outcome := 'refused';
        DELETE FROM budget_holds h WHERE h.id = p_hold_id;  -- no-op when step 1 refused
    END IF;

    -- 4. Take the amount and record the newest policy. The rows are locked already (or, for a refusal, written
    --    only when the policy changed, so refusals stay lock-free and write nothing in the common case).
    UPDATE budget_periods b
       SET held_usd = b.held_usd + CASE WHEN outcome = 'refused' THEN 0 ELSE v_amount END,
           limit_usd = CASE WHEN b.scope_kind = 'org' THEN p_org_limit ELSE p_agent_limit END,
           enforcement = p_enforcement,
           updated_at = now()
     WHERE b.org_id = v_org
       AND b.scope_id IN (v_org, p_agent_id)
       AND b.period_start = p_period_start
       AND (outcome <> 'refused'
            OR b.limit_usd IS DISTINCT FROM CASE WHEN b.scope_kind = 'org' THEN p_org_limit ELSE p_agent_limit END
            OR b.enforcement IS DISTINCT FROM p_enforcement);
END
$$;

-- Settle a hold of the current org to the actual cost. Returns the hold's status before the call: 'held',
-- 'expired' or 'released' (now settled), 'settled' (already was: nothing changed), or NULL (no such hold).
-- Spend is counted once, by the ledger row: if the request already has one, spent_usd already includes it.
CREATE FUNCTION ibex_budget_settle(
    p_hold_id           uuid,
    p_actual            numeric,
    p_model             text,
    p_prompt_tokens     integer,
    p_completion_tokens integer)
    RETURNS text
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_hold      budget_holds%ROWTYPE;
    v_actual    numeric(18, 8) := p_actual;
    v_release   numeric(18, 8);
    v_spend     numeric(18, 8);
BEGIN
    SELECT * INTO v_hold FROM budget_holds h WHERE h.id = p_hold_id AND h.org_id = ibex_current_org() FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF v_hold.status = 'settled' THEN
        RETURN 'settled';
    END IF;

    INSERT INTO budget_ledger (org_id, agent_id, request_id, model, prompt_tokens, completion_tokens, cost_usd)
    VALUES (v_hold.org_id, v_hold.agent_id, v_hold.request_id, p_model, p_prompt_tokens, p_completion_tokens,
            v_actual)
    ON CONFLICT (org_id, request_id) DO NOTHING;
    v_spend := CASE WHEN FOUND THEN v_actual ELSE 0 END;
    -- An expired or released hold was already taken out of held_usd.
    v_release := CASE WHEN v_hold.status = 'held' THEN v_hold.amount_usd ELSE 0 END;

    UPDATE budget_holds h
       SET status = 'settled', actual_usd = v_actual, settled_at = now()
     WHERE h.id = p_hold_id;

    -- The budget rows last: from here to COMMIT, holds on these scopes wait. Org row first, then the agent's.
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v_release, spent_usd = b.spent_usd + v_spend, updated_at = now()
     WHERE b.org_id = v_hold.org_id AND b.scope_id = v_hold.org_id AND b.period_start = v_hold.period_start;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v_release, spent_usd = b.spent_usd + v_spend, updated_at = now()
     WHERE b.org_id = v_hold.org_id AND b.scope_id = v_hold.agent_id AND b.period_start = v_hold.period_start;
    RETURN v_hold.status;
END
$$;

-- Release a hold of the current org whose request never used the provider. Returns the status before the call;
-- only 'held' changed anything. NULL: no such hold.
CREATE FUNCTION ibex_budget_release(p_hold_id uuid)
    RETURNS text
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_hold  budget_holds%ROWTYPE;
BEGIN
    SELECT * INTO v_hold FROM budget_holds h WHERE h.id = p_hold_id AND h.org_id = ibex_current_org() FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF v_hold.status <> 'held' THEN
        RETURN v_hold.status;
    END IF;
    UPDATE budget_holds h SET status = 'released', settled_at = now() WHERE h.id = p_hold_id;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v_hold.amount_usd, updated_at = now()
     WHERE b.org_id = v_hold.org_id AND b.scope_id = v_hold.org_id AND b.period_start = v_hold.period_start;
    UPDATE budget_periods b
       SET held_usd = b.held_usd - v_hold.amount_usd, updated_at = now()
     WHERE b.org_id = v_hold.org_id AND b.scope_id = v_hold.agent_id AND b.period_start = v_hold.period_start;
    RETURN 'held';
END
$$;

-- Expire up to p_limit 'held' holds whose expires_at has passed, in every org, and take them out of held_usd.
-- Returns how many it expired. Concurrent sweepers (one per proxy replica) skip each other's holds, and holds that
-- a settle or release is working on right now. Runs as the migrating role, which bypasses row-level security.
-- search_path ends with pg_temp and every table is schema-qualified: a caller's temporary table cannot stand in.
CREATE FUNCTION ibex_sweep_expired_holds(p_limit integer)
    RETURNS integer
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
DECLARE
    v_count     integer;
    v_orgs      uuid[];
    v_agents    uuid[];
    v_periods   date[];
    v_amounts   numeric[];
    v_scope     record;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'p_limit must be positive' USING ERRCODE = 'invalid_parameter_value';
    END IF;

    WITH expired AS (
        SELECT h.id
          FROM public.budget_holds h
         WHERE h.status = 'held' AND h.expires_at <= now()
         ORDER BY h.expires_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), swept AS (
        UPDATE public.budget_holds h
           SET status = 'expired', settled_at = now()
          FROM expired e
         WHERE h.id = e.id
        RETURNING h.org_id, h.agent_id, h.period_start, h.amount_usd
    )
    SELECT count(*), array_agg(s.org_id), array_agg(s.agent_id), array_agg(s.period_start), array_agg(s.amount_usd)
      INTO v_count, v_orgs, v_agents, v_periods, v_amounts
      FROM swept s;

    FOR v_scope IN
        SELECT d.org_id, d.period_start, k.scope_id, sum(d.amount) AS amount
          FROM unnest(v_orgs, v_agents, v_periods, v_amounts) AS d (org_id, agent_id, period_start, amount)
         CROSS JOIN LATERAL (VALUES (0, d.org_id), (1, d.agent_id)) AS k (rank, scope_id)
         GROUP BY d.org_id, d.period_start, k.rank, k.scope_id
         ORDER BY d.org_id, d.period_start, k.rank, k.scope_id
    LOOP
        UPDATE public.budget_periods b
           SET held_usd = b.held_usd - v_scope.amount, updated_at = now()
         WHERE b.org_id = v_scope.org_id AND b.scope_id = v_scope.scope_id AND b.period_start = v_scope.period_start;
    END LOOP;
    RETURN v_count;
END
$$;

REVOKE ALL ON FUNCTION ibex_budget_lock_scope(text, uuid, date, numeric, text),
    ibex_budget_hold(uuid, uuid, text, date, numeric, numeric, numeric, text, interval),
    ibex_budget_settle(uuid, numeric, text, integer, integer),
    ibex_budget_release(uuid),
    ibex_sweep_expired_holds(integer)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ibex_budget_lock_scope(text, uuid, date, numeric, text),
    ibex_budget_hold(uuid, uuid, text, date, numeric, numeric, numeric, text, interval),
    ibex_budget_settle(uuid, numeric, text, integer, integer),
    ibex_budget_release(uuid),
    ibex_sweep_expired_holds(integer)
    TO ibex_app;

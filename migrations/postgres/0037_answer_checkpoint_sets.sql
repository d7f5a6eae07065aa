-- 0037: the batch's checkpoints as sets. After 0036 they were three quarters of the batch statement's time (one
-- function call per turn: the session upserted, the checkpoint and its capture job inserted, each a statement of
-- its own). Now each session of the batch is upserted once, its count moved by all its turns, and the batch's
-- checkpoints and capture jobs go in one insert each; the turn numbers are the session's count before plus the
-- turn's place among the session's turns of the batch, as 0030's function numbered them one by one. A checkpoint
-- that fails still undoes nothing but checkpoints: the block is undone and each turn retried alone, through
-- ibex_session_turn_capture_as, as in 0036. Settles are as in 0036.
--
-- A correction to 0036's header: the proxy sends at most 64 answers per batch (ibex_dataplane.proxy.settles), so
-- its batches never overflowed the backend's cache of 64 subtransactions; what 0036 saved there was the cost of a
-- subtransaction per turn, not an overflow.
CREATE OR REPLACE FUNCTION ibex_answer_settle_batch_as(p_org uuid, p_agent uuid, p_items jsonb, p_ttl interval)
    RETURNS TABLE (hold_status text, turn integer, checkpoint_error text)
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    v_n         integer := jsonb_array_length(p_items);
    v_status    text[] := array_fill(NULL::text, ARRAY[v_n]);
    v_turns     integer[] := array_fill(NULL::integer, ARRAY[v_n]);
    v_errors    text[] := array_fill(NULL::text, ARRAY[v_n]);
    v_item      jsonb;
    v_at        integer;
    v           record;
    v_leases    uuid[] := '{}';
    v_drawn     numeric[] := '{}';
    v_actuals   numeric[] := '{}';
    v_agents    uuid[] := '{}';
    v_periods   date[] := '{}';
    v_releases  numeric[] := '{}';
    v_spends    numeric[] := '{}';
    v_one_by_one boolean := false;
    v_draws     integer := 0;
BEGIN
    PERFORM ibex_set_tenant(p_org, p_agent);
    -- The draws: their leases locked once, in id order (the lock order of 0002: holds, then budget rows), and a
    -- ledger row for the first item of each request id that has none yet.
    FOR v IN
        WITH asked AS (
            SELECT e.at::integer AS at, (e.item->>'hold')::uuid AS lease, e.item->>'request_id' AS request_id,
                   (e.item->>'drawn')::numeric AS drawn, (e.item->>'actual')::numeric(18, 8) AS actual,
                   e.item->>'model' AS model, (e.item->>'prompt_tokens')::integer AS prompt_tokens,
                   (e.item->>'completion_tokens')::integer AS completion_tokens
              FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, at)
             WHERE e.item ? 'drawn'
        ), l AS (
            SELECT h.id, h.org_id, h.agent_id, h.status
              FROM budget_holds h
             WHERE h.id IN (SELECT a.lease FROM asked a) AND h.org_id = ibex_current_org()
               AND h.request_id LIKE 'lease\_%'
             ORDER BY h.id
               FOR UPDATE
        ), d AS (
            SELECT a.*, l.org_id, l.agent_id, l.status AS lease_status, l.id IS NOT NULL AS found,
                   row_number() OVER (PARTITION BY a.request_id, l.id IS NOT NULL ORDER BY a.at) AS nth
              FROM asked a LEFT JOIN l ON l.id = a.lease
        ), written AS (
            INSERT INTO budget_ledger (org_id, agent_id, request_id, model, prompt_tokens, completion_tokens, cost_usd)
            SELECT d.org_id, d.agent_id, d.request_id, d.model, d.prompt_tokens, d.completion_tokens, d.actual
              FROM d
             WHERE d.found AND d.nth = 1
            ON CONFLICT (org_id, request_id) DO NOTHING
            RETURNING budget_ledger.request_id
        )
        SELECT d.at, d.lease, d.request_id, d.drawn, d.actual, d.lease_status, d.found,
               d.found AND d.nth = 1 AND w.request_id IS NOT NULL AS fresh
          FROM d LEFT JOIN written w ON w.request_id = d.request_id
    LOOP
        v_draws := v_draws + 1;
        IF v.drawn IS NULL OR v.drawn < 0 OR v.request_id IS NULL OR v.request_id LIKE 'lease\_%' THEN
            -- the whole statement fails, the ledger rows written above with it
            RAISE EXCEPTION 'a draw needs its request id and an amount >= 0' USING ERRCODE = 'invalid_parameter_value';
        ELSIF NOT v.found THEN
            CONTINUE;  -- no such lease of this org: NULL, nothing written
        ELSIF NOT v.fresh THEN
            v_status[v.at] := 'settled';
        ELSE
            v_status[v.at] := v.lease_status;
            v_leases := v_leases || v.lease;
            v_drawn := v_drawn || v.drawn;
            v_actuals := v_actuals || v.actual;
        END IF;
    END LOOP;

    -- Each lease moved once: an expired or released lease was already taken out of held_usd and releases nothing.
    IF cardinality(v_leases) > 0 THEN
        FOR v IN
            WITH s AS (
                SELECT u.lease, sum(u.drawn) AS drawn, sum(u.actual) AS actual
                  FROM unnest(v_leases, v_drawn, v_actuals) AS u(lease, drawn, actual)
                 GROUP BY u.lease
            ), r AS (
                SELECT h.id, h.agent_id, h.period_start, s.actual,
                       CASE WHEN h.status = 'held' THEN least(s.drawn, h.amount_usd) ELSE 0 END AS release
                  FROM budget_holds h JOIN s ON s.lease = h.id
            )
            UPDATE budget_holds h
               SET amount_usd = h.amount_usd - r.release, actual_usd = coalesce(h.actual_usd, 0) + r.actual
              FROM r
             WHERE h.id = r.id
            RETURNING r.agent_id, r.period_start, r.release, r.actual
        LOOP
            v_agents := v_agents || v.agent_id;
            v_periods := v_periods || v.period_start;
            v_releases := v_releases || v.release;
            v_spends := v_spends || v.actual;
        END LOOP;
    END IF;

    -- Ordinary holds (no lease), one by one as in 0034.
    IF v_draws < v_n THEN
        FOR v_item, v_at IN SELECT e.item, e.at::integer
                              FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, at)
                             WHERE NOT e.item ? 'drawn' LOOP
            SELECT * INTO v FROM ibex_budget_settle_hold(
                (v_item->>'hold')::uuid, (v_item->>'actual')::numeric, v_item->>'model',
                (v_item->>'prompt_tokens')::integer, (v_item->>'completion_tokens')::integer);
            v_status[v_at] := v.status;
            IF v.status IS NOT NULL AND v.status <> 'settled' THEN
                v_agents := v_agents || v.agent_id;
                v_periods := v_periods || v.period_start;
                v_releases := v_releases || v.release_usd;
                v_spends := v_spends || v.spend_usd;
            END IF;
        END LOOP;
    END IF;

    -- The checkpoints as sets, in one subtransaction: each session of the batch opened (or reopened) once and
    -- moved by its turns, its turns numbered on from its count in the order given, their checkpoints and capture
    -- jobs in one insert each. Sessions are locked in order of their id by code point, the order the caller sorted
    -- them in and the one-by-one path below takes, so that two batches of one agent cannot deadlock.
    BEGIN
        WITH asked AS (
            SELECT e.at::integer AS at, e.item->>'session' AS external_id, e.item
              FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e(item, at)
        ), counted AS (
            SELECT a.external_id, count(*)::integer AS turns FROM asked a GROUP BY a.external_id
        ), opened AS (
            INSERT INTO sessions (org_id, agent_id, external_id, turn_count)
            SELECT p_org, p_agent, c.external_id, c.turns FROM counted c ORDER BY c.external_id COLLATE "C"
            ON CONFLICT (org_id, agent_id, external_id) DO UPDATE SET
                turn_count = sessions.turn_count + excluded.turn_count, last_activity_at = now(),
                status = 'active', closed_at = NULL, close_reason = NULL
            RETURNING sessions.id, sessions.external_id, sessions.turn_count
        ), numbered AS (
            SELECT a.at, a.item, o.id AS session_id,
                   (o.turn_count - c.turns + row_number() OVER (PARTITION BY a.external_id ORDER BY a.at))::integer
                       AS number
              FROM asked a
              JOIN opened o ON o.external_id = a.external_id
              JOIN counted c ON c.external_id = a.external_id
        ), checkpointed AS (
            INSERT INTO session_checkpoints (session_id, turn, org_id, agent_id, request_id, messages_sha256,
                                             completion_sha256, prompt_tokens, completion_tokens, latency_ms)
            SELECT n.session_id, n.number, p_org, p_agent, n.item->>'request_id',
                   ARRAY(SELECT jsonb_array_elements_text(n.item->'messages')), n.item->>'completion',
                   (n.item->>'prompt_tokens')::integer, (n.item->>'completion_tokens')::integer,
                   (n.item->>'latency_ms')::real
              FROM numbered n
            ON CONFLICT DO NOTHING
        ), queued AS (
            INSERT INTO capture_jobs (org_id, agent_id, session_id, turn, request_id, mode, model, messages,
                                      observed_at, expires_at)
            SELECT p_org, p_agent, n.item->>'session', n.number, n.item->>'request_id', n.item->>'mode',
                   n.item->>'capture_model', n.item->'capture',
                   coalesce((n.item->>'observed_at')::timestamptz, now()), now() + p_ttl
              FROM numbered n
             WHERE jsonb_typeof(n.item->'capture') IN ('array', 'object')
            ON CONFLICT DO NOTHING
        )
        SELECT coalesce(array_agg(n.number ORDER BY n.at), '{}') INTO v_turns FROM numbered n;
    EXCEPTION WHEN OTHERS THEN
        v_one_by_one := true;  -- all of it undone: each turn again, in a subtransaction of its own
    END;
    IF v_one_by_one THEN
        v_turns := array_fill(NULL::integer, ARRAY[v_n]);
        v_at := 0;
        FOR v_item IN SELECT e.item FROM jsonb_array_elements(p_items) AS e(item) LOOP
            v_at := v_at + 1;
            BEGIN
                v_turns[v_at] := ibex_session_turn_capture_as(
                    p_org, p_agent, v_item->>'session', v_item->>'request_id',
                    ARRAY(SELECT jsonb_array_elements_text(v_item->'messages')), v_item->>'completion',
                    (v_item->>'prompt_tokens')::integer, (v_item->>'completion_tokens')::integer,
                    (v_item->>'latency_ms')::real, v_item->>'mode', v_item->>'capture_model',
                    CASE WHEN jsonb_typeof(v_item->'capture') IN ('array', 'object') THEN v_item->'capture' END,
                    (v_item->>'observed_at')::timestamptz, p_ttl);
            EXCEPTION WHEN OTHERS THEN
                v_errors[v_at] := SQLSTATE;  -- the code only: a message could quote tenant data into a log line
            END;
        END LOOP;
    END IF;

    -- The budget rows last, once each by the batch's sums: org row first, then the agents'.
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

    FOR v_at IN 1 .. v_n LOOP
        hold_status := v_status[v_at];
        turn := v_turns[v_at];
        checkpoint_error := v_errors[v_at];
        RETURN NEXT;
    END LOOP;
END
$$;

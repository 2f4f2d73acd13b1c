-- The code objects of a table: the SQL staging function and the wake-up trigger. CREATE OR
-- REPLACE (and a trigger created only where it is missing): `drain migrate` runs this file every
-- time, after the schema is current, so a new release's function body replaces the old one.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

-- The SQL API for apps in any language: one call stages one job, in the caller's transaction.
-- Versioned by name: a later, different signature becomes a new function (..._v2) beside this
-- one, so a deployed app's calls keep working.
-- A bad job raises 22023 (invalid_parameter_value) with a message naming the argument, and
-- nothing is inserted. The rules of the columns are the table's: its constraint drain_job_check
-- calls drain_job_check_v1 (checks.sql), which raises 22023 naming the column, so the INSERT
-- below checks them at no extra cost; here only what the table cannot see (a NULL, which its NOT
-- NULL would refuse with another code; run_at with delay_s) is checked first. drain.stage()
-- (drain/staging/rows.py) refuses the same with a StagingError. No EXCEPTION block: it would open
-- a subtransaction on every call.
-- What it costs over the same INSERT (bench/README.md, "What drain_stage_v1() costs"): about
-- 2 us of server CPU per call on PostgreSQL 15, the plpgsql call and its nested statement, well
-- under 1% of a commit; its own tests well under 1 us. LANGUAGE sql is not cheaper here: a SQL
-- function that writes cannot be inlined, and before PostgreSQL 18 its body is planned again
-- on every call (2 to 3.5 times the INSERT's server time, measured).
CREATE OR REPLACE FUNCTION {schema}.{stage_function}(
    job_name   text,
    job_args   jsonb       DEFAULT '[]',
    job_kwargs jsonb       DEFAULT '{{}}',
    queue      text        DEFAULT 'default',
    backend    text        DEFAULT 'default',
    run_at     timestamptz DEFAULT NULL,
    delay_s    float8      DEFAULT NULL,
    job_id     uuid        DEFAULT NULL,
    options    jsonb       DEFAULT '{{}}'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    new_id uuid := coalesce(job_id, gen_random_uuid());
BEGIN
    -- The common call (no delay_s, no NULL) passes one test; the three below run only otherwise.
    IF delay_s IS NOT NULL OR job_name IS NULL OR job_args IS NULL OR job_kwargs IS NULL OR queue IS NULL
       OR backend IS NULL OR options IS NULL THEN
        IF run_at IS NOT NULL AND delay_s IS NOT NULL THEN
            RAISE EXCEPTION 'drain: give run_at or delay_s, not both' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- NaN compares above every number in Postgres, so this refuses NaN and both infinities.
        IF delay_s IS NOT NULL AND NOT (delay_s >= 0 AND delay_s <= 3162240000) THEN
            RAISE EXCEPTION 'drain: delay_s must be between 0 and 3162240000 seconds, not %', delay_s
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF job_name IS NULL OR job_args IS NULL OR job_kwargs IS NULL OR queue IS NULL OR backend IS NULL
           OR options IS NULL THEN
            PERFORM {schema}.drain_job_check_v1(job_name, job_args, job_kwargs, queue, backend, run_at, options, now(), 0);
        END IF;
    END IF;
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
    VALUES (job_name, job_args, job_kwargs, queue, backend, new_id,
            coalesce(now() + make_interval(secs => delay_s), run_at), options);
    RETURN new_id;
END;
$$;

-- Version 2: version 1 and an ordering key (NULL: none). Its rules are the table's too: the
-- constraint drain_key_check calls drain_key_check_v1 (checks.sql), which raises 22023 naming
-- ordering_key, so the key adds no test here and the common call, keyed or not, passes the one
-- test of version 1 (tests/staging/test_staging_languages.py counts the calls of the check
-- functions; bench/README.md: it costs what version 1 does over the same INSERT). The INSERT
-- names ordering_key even when it is NULL: a role calling this function needs INSERT on that
-- column (deploy/database/producer-role.sql).
CREATE OR REPLACE FUNCTION {schema}.{stage_function_v2}(
    job_name     text,
    job_args     jsonb       DEFAULT '[]',
    job_kwargs   jsonb       DEFAULT '{{}}',
    queue        text        DEFAULT 'default',
    backend      text        DEFAULT 'default',
    run_at       timestamptz DEFAULT NULL,
    delay_s      float8      DEFAULT NULL,
    job_id       uuid        DEFAULT NULL,
    options      jsonb       DEFAULT '{{}}',
    ordering_key text        DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    new_id uuid := coalesce(job_id, gen_random_uuid());
BEGIN
    -- The common call (no delay_s, no NULL but the key) passes one test, as in version 1.
    IF delay_s IS NOT NULL OR job_name IS NULL OR job_args IS NULL OR job_kwargs IS NULL OR queue IS NULL
       OR backend IS NULL OR options IS NULL THEN
        IF run_at IS NOT NULL AND delay_s IS NOT NULL THEN
            RAISE EXCEPTION 'drain: give run_at or delay_s, not both' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- NaN compares above every number in Postgres, so this refuses NaN and both infinities.
        IF delay_s IS NOT NULL AND NOT (delay_s >= 0 AND delay_s <= 3162240000) THEN
            RAISE EXCEPTION 'drain: delay_s must be between 0 and 3162240000 seconds, not %', delay_s
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF job_name IS NULL OR job_args IS NULL OR job_kwargs IS NULL OR queue IS NULL OR backend IS NULL
           OR options IS NULL THEN
            PERFORM {schema}.drain_job_check_v1(job_name, job_args, job_kwargs, queue, backend, run_at, options, now(), 0);
        END IF;
    END IF;
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key)
    VALUES (job_name, job_args, job_kwargs, queue, backend, new_id,
            coalesce(now() + make_interval(secs => delay_s), run_at), options, ordering_key);
    RETURN new_id;
END;
$$;

-- The wake-up (drain.relay.wakeup): a producer's INSERT notifies the drain only while the idle leader
-- sleeps. The leader holds the table's wake lock (a session advisory lock) exactly while it sleeps
-- on LISTEN; every INSERT statement probes it with a shared try-lock, held until the producer's
-- transaction ends. Taken: the drain is awake, nothing is paid (NOTIFY takes a global lock at
-- commit that serializes every notifying commit). Refused: the drain sleeps, so notify it. The
-- leader cannot take the lock while a producer that probed is still open, so no commit falls
-- between "the drain checked" and "the drain sleeps". Transaction-scoped only: safe through a
-- transaction-pooling proxy, and any language's plain INSERT fires it.
CREATE OR REPLACE FUNCTION {schema}.drain_wake_v1() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $drain$
DECLARE
    wake_key bigint := pg_catalog.hashtextextended(
        'drain-wake:' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, 0);
BEGIN
    IF TG_OP = 'DELETE' AND pg_catalog.current_setting('drain.settling', true) = 'on' THEN
        RETURN NULL;  -- the drain's own settlement: a key it frees is its own lane's, and it is awake
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(wake_key) THEN
        PERFORM pg_catalog.pg_notify('drain_wake_' || pg_catalog.to_hex(wake_key), '');
    END IF;
    RETURN NULL;
END;
$drain$;

-- The same with wake slots, for a table with lanes (drain.relay.lanes): each idle member sleeps
-- holding a wake lock of its own, slot 0, 1, ... (the trigger's argument says how many; slot 0's
-- key is drain_wake_v1's), so each probe takes every slot shared and notifies once if any slot
-- was refused. Every member LISTENs on the one channel: a commit wakes every sleeping member,
-- among them its rows' lanes' leaders. One slot (no argument): drain_wake_v1's work exactly.
CREATE OR REPLACE FUNCTION {schema}.drain_wake_v2() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $drain$
DECLARE
    wake_name text := 'drain-wake:' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME;
    slots integer := coalesce(TG_ARGV[0]::integer, 1);
    asleep boolean := false;
BEGIN
    IF TG_OP = 'DELETE' AND pg_catalog.current_setting('drain.settling', true) = 'on' THEN
        RETURN NULL;
    END IF;
    FOR slot IN 0 .. slots - 1 LOOP
        IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(pg_catalog.hashtextextended(wake_name, slot)) THEN
            asleep := true;
        END IF;
    END LOOP;
    IF asleep THEN
        PERFORM pg_catalog.pg_notify(
            'drain_wake_' || pg_catalog.to_hex(pg_catalog.hashtextextended(wake_name, 0)), '');
    END IF;
    RETURN NULL;
END;
$drain$;

-- Once per INSERT statement (not per row); pg_notify collapses a transaction's repeats into one.
-- One function serves every table of the schema: the key comes from the trigger's own table.
DO $drain$
DECLARE
    state "char";
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name} AND t.tgname = 'drain_wake'
    ) THEN
        CREATE TRIGGER drain_wake AFTER INSERT ON {schema}.{table}
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.drain_wake_v1();
    END IF;
    -- An UPDATE that sets run_at (``SET run_at = NULL`` forwards a parked or delayed row now) or
    -- last_error (``SET last_error = NULL`` releases a row parked in place) wakes the leader too;
    -- without it the row waited for the safety-net poll, counted as a missed wake-up. A table
    -- migrated with the run_at-only trigger gets the wider one.
    IF NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name} AND t.tgname = 'drain_wake_due'
          AND pg_catalog.array_length(t.tgattr::int2[], 1) = 2
    ) THEN
        DROP TRIGGER IF EXISTS drain_wake_due ON {schema}.{table};
        CREATE TRIGGER drain_wake_due AFTER UPDATE OF run_at, last_error ON {schema}.{table}
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.drain_wake_v1();
    END IF;
    -- A DELETE wakes the leader too: deleting the row ahead of a keyed row (the cleanup of a parked
    -- row, an app cancelling a job) frees the rows behind it, which no INSERT announces. Not the
    -- drain's own deletes (its settlement statement sets a setting of its own, queries.sql delete_ids):
    -- the keys it frees are of its own lanes, and it is awake. Created in the state drain_wake is in
    -- (an operator's ENABLE ALWAYS, for a table a logical-replication subscriber applies changes to,
    -- holds for the DELETE too).
    IF NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name} AND t.tgname = 'drain_wake_freed'
    ) THEN
        CREATE TRIGGER drain_wake_freed AFTER DELETE ON {schema}.{table}
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.drain_wake_v1();
        SELECT t.tgenabled INTO state FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name} AND t.tgname = 'drain_wake';
        IF state IS NOT NULL AND state <> 'O' THEN  -- disabled (D), replicas only (R), always (A)
            EXECUTE pg_catalog.format('ALTER TABLE %I.%I %s TRIGGER drain_wake_freed', {schema_name}, {table_name},
                CASE state WHEN 'D' THEN 'DISABLE' WHEN 'R' THEN 'ENABLE REPLICA' ELSE 'ENABLE ALWAYS' END);
        END IF;
    END IF;
END;
$drain$;

-- With lanes, the three triggers call drain_wake_v2 with the table's wake slots: as many as `drain
-- migrate`'s config asks for (its lanes, at most drain.store.migrations.MAX_WAKE_SLOTS), never
-- fewer than the triggers have (a migration run with another config, Django's say, must not leave
-- sleeping members unwoken). Recreated only when the count grows, each in the state it was in.
DO $drain$
DECLARE
    found record;
    slots integer := {wake_slots};
BEGIN
    FOR found IN
        SELECT t.tgname, pg_catalog.pg_get_triggerdef(t.oid) AS def
        FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name}
          AND t.tgname IN ('drain_wake', 'drain_wake_due', 'drain_wake_freed')
    LOOP
        slots := greatest(slots, coalesce(
            pg_catalog.substring(found.def, 'drain_wake_v2\(''([0-9]+)''\)')::integer, 1));
    END LOOP;
    IF slots = 1 THEN
        RETURN;
    END IF;
    FOR found IN
        SELECT t.tgname, t.tgenabled, pg_catalog.pg_get_triggerdef(t.oid) AS def
        FROM pg_catalog.pg_trigger t
        JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relname = {table_name}
          AND t.tgname IN ('drain_wake', 'drain_wake_due', 'drain_wake_freed')
    LOOP
        CONTINUE WHEN pg_catalog.strpos(found.def, 'drain_wake_v2(''' || slots || ''')') > 0;
        EXECUTE pg_catalog.format('DROP TRIGGER %I ON %I.%I', found.tgname, {schema_name}, {table_name});
        EXECUTE pg_catalog.format(
            'CREATE TRIGGER %I AFTER %s ON %I.%I FOR EACH STATEMENT EXECUTE FUNCTION %I.drain_wake_v2(%L)',
            found.tgname,
            CASE found.tgname WHEN 'drain_wake' THEN 'INSERT' WHEN 'drain_wake_freed' THEN 'DELETE'
                              ELSE 'UPDATE OF run_at, last_error' END,
            {schema_name}, {table_name}, {schema_name}, slots::text);
        IF found.tgenabled <> 'O' THEN  -- disabled (D), for replicas only (R), always (A): kept
            EXECUTE pg_catalog.format('ALTER TABLE %I.%I %s TRIGGER %I', {schema_name}, {table_name},
                CASE found.tgenabled WHEN 'D' THEN 'DISABLE' WHEN 'R' THEN 'ENABLE REPLICA'
                                     ELSE 'ENABLE ALWAYS' END,
                found.tgname);
        END IF;
    END LOOP;
END;
$drain$;

-- The staged-jobs table, its dead letters and its schedules' last ticks. Idempotent: running it again changes nothing.
-- The schema, table and index names are quoted identifiers filled in by drain.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.{table} (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_name    text        NOT NULL CHECK (job_name <> ''),
    job_args    jsonb       NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(job_args) = 'array'),
    job_kwargs  jsonb       NOT NULL DEFAULT '{{}}' CHECK (jsonb_typeof(job_kwargs) = 'object'),
    queue       text        NOT NULL DEFAULT 'default',
    backend     text        NOT NULL DEFAULT 'default',
    job_id      uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    run_at      timestamptz NULL,
    options     jsonb       NOT NULL DEFAULT '{{}}' CHECK (jsonb_typeof(options) = 'object'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text        NULL
);

-- Rows due now: a partial index in id order, so the batch query never walks future rows.
CREATE INDEX IF NOT EXISTS {due_index} ON {schema}.{table} (id) WHERE run_at IS NULL;
-- Rows with a run_at (deferred, or backing off after a failure), in the order they fall due.
CREATE INDEX IF NOT EXISTS {run_at_index} ON {schema}.{table} (run_at, id) WHERE run_at IS NOT NULL;

-- A queue table churns: vacuum it after a fixed number of dead rows, not a fraction of its size.
ALTER TABLE {schema}.{table} SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000
);

CREATE TABLE IF NOT EXISTS {schema}.{dead} (
    id          bigint      PRIMARY KEY,
    job_name    text        NOT NULL,
    job_args    jsonb       NOT NULL,
    job_kwargs  jsonb       NOT NULL,
    queue       text        NOT NULL,
    backend     text        NOT NULL,
    job_id      uuid        NOT NULL,
    run_at      timestamptz NULL,
    options     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL,
    attempts    integer     NOT NULL,
    last_error  text        NULL,
    dead_at     timestamptz NOT NULL DEFAULT now(),
    error       text        NOT NULL
);

CREATE INDEX IF NOT EXISTS {dead_job_id_index} ON {schema}.{dead} (job_id);

-- One row per [[schedules]] entry the leader has seen: the last tick it staged (or skipped),
-- updated in the transaction that stages the tick's job, so a tick is staged exactly once across
-- restarts and failovers. A schedule removed from the config keeps its row, untouched.
CREATE TABLE IF NOT EXISTS {schema}.{schedules} (
    name        text        PRIMARY KEY CHECK (name <> ''),
    cron        text        NOT NULL,
    timezone    text        NOT NULL,
    last_tick   timestamptz NOT NULL,
    last_job_id uuid        NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The wake-up (drain.wakeup): a producer's INSERT notifies the drain only while the idle leader
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
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(wake_key) THEN
        PERFORM pg_catalog.pg_notify('drain_wake_' || pg_catalog.to_hex(wake_key), '');
    END IF;
    RETURN NULL;
END;
$drain$;

-- Once per INSERT statement (not per row); pg_notify collapses a transaction's repeats into one.
-- One function serves every table of the schema: the key comes from the trigger's own table.
DO $drain$
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
END;
$drain$;

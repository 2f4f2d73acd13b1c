-- Every statement drain runs, as named blocks ("-- name: <name>"), loaded once by drain.sql.
-- Table and schema placeholders are filled with quoted identifiers; %(name)s are bind parameters.

-- name: lock_held
-- Is this session the one holding the leader lock? Catches a pooler handing us another backend.
-- A settlement (relaxed) commits without waiting for the WAL flush, in this same round trip: a
-- settlement lost to a crash of Postgres only means its rows are forwarded again (Store.batch).
SELECT pg_backend_pid() AS pid,
       EXISTS (
           SELECT 1 FROM pg_locks
           WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
             AND classid = %(classid)s AND objid = %(objid)s AND objsubid = 1
       ) AS held,
       CASE WHEN %(relaxed)s THEN set_config('synchronous_commit', 'off', true) END AS relaxed;

-- name: try_lock
SELECT pg_try_advisory_lock(%(key)s) AS acquired, pg_backend_pid() AS pid;

-- name: unlock
SELECT pg_advisory_unlock(%(key)s) AS released;

-- name: select_due
-- Due rows in id order: those staged for now (run_at null) and those whose run_at has passed.
-- Each branch walks its own index, so a million future rows cost nothing here. ``exclude``
-- holds the rows of the batch still in flight (published, confirms awaited) in a pipelined loop.
-- age_s (drain_commit_to_publish_seconds) runs from the staging transaction's commit when the
-- server records commit times (track_commit_timestamp = on) and the row was never retried, else
-- from created_at, the staging transaction's start.
SELECT id, job_id, job_name, job_args, job_kwargs, queue, backend, options, created_at,
       attempts, run_at,
       extract(epoch FROM clock_timestamp() - coalesce(
           CASE WHEN attempts = 0 AND current_setting('track_commit_timestamp') = 'on'
                THEN pg_xact_commit_timestamp(staged_xmin) END,
           created_at))::float8 AS age_s
FROM (
    (SELECT *, xmin AS staged_xmin FROM {schema}.{table}
     WHERE run_at IS NULL AND backend <> ALL(%(paused)s::text[])
       AND id <> ALL(%(exclude)s::bigint[])
     ORDER BY id LIMIT %(limit)s)
    UNION ALL
    (SELECT *, xmin AS staged_xmin FROM {schema}.{table}
     WHERE run_at <= now() AND backend <> ALL(%(paused)s::text[])
       AND id <> ALL(%(exclude)s::bigint[])
     ORDER BY run_at, id LIMIT %(limit)s)
) AS due
ORDER BY id
LIMIT %(limit)s;

-- name: delete_ids
DELETE FROM {schema}.{table} WHERE id = ANY(%(ids)s::bigint[]);

-- name: record_failures
-- One UPDATE for every failed row of a batch: attempts, last error, and when to try again.
UPDATE {schema}.{table} AS t
SET attempts = t.attempts + f.counted,
    last_error = f.error,
    run_at = now() + make_interval(secs => f.delay_s)
FROM unnest(%(ids)s::bigint[], %(counted)s::int[], %(errors)s::text[], %(delays)s::float8[])
     AS f(id, counted, error, delay_s)
WHERE t.id = f.id;

-- name: bury
-- Move rows to the dead-letter table with their error, in the batch's transaction.
WITH failed AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
), moved AS (
    DELETE FROM {schema}.{table} AS t USING failed WHERE t.id = failed.id
    RETURNING t.*, failed.error
)
INSERT INTO {schema}.{dead}
    (id, job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, created_at,
     attempts, last_error, error)
SELECT id, job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, created_at,
       attempts + 1, error, error
FROM moved;

-- name: seconds_until_due
-- How long until the earliest future row falls due, so an idle leader can wake for it. Measured
-- on the database's clock: the drain's own clock may be skewed.
SELECT extract(epoch FROM min(run_at) - clock_timestamp())::float8 AS seconds
FROM {schema}.{table} WHERE run_at > now();

-- name: set_timeouts
-- The session's timeouts, SET after connecting (a startup ``options`` parameter can be dropped
-- silently by a pooler) and read back by ``session_timeouts``.
SELECT set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, false);

-- name: session_timeouts
-- In milliseconds, whatever unit they were set in.
SELECT (SELECT setting FROM pg_settings WHERE name = 'statement_timeout')::bigint
           AS statement_timeout,
       (SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout')::bigint
           AS idle_timeout;

-- name: insert_job
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
VALUES (%(job_name)s, %(job_args)s::jsonb, %(job_kwargs)s::jsonb, %(queue)s, %(backend)s,
        %(job_id)s::uuid,
        coalesce(now() + make_interval(secs => %(delay_s)s::float8), %(run_at)s::timestamptz),
        %(options)s::jsonb);

-- name: insert_jobs
-- Many jobs in one statement and one round trip: the rows travel as one JSON array.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id,
       coalesce(now() + make_interval(secs => delay_s), run_at), options
FROM jsonb_to_recordset(%(jobs)s::jsonb) AS j(
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, delay_s float8, options jsonb
);

-- name: status
-- The table's figures, for `drain status` and the leader's gauges: one definition for both.
-- Every part walks an index (the due branch, the run_at branch) and each count stops at
-- %(cap)s rows (NULL: no cap, an exact count for the CLI), so the gauges never cost a full scan.
-- The lag is the age of the oldest due row: the lowest-id row staged for now (since created_at)
-- or the earliest passed run_at (since it fell due).
WITH parts AS (
    SELECT
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table} WHERE run_at IS NULL
                               LIMIT %(cap)s) AS n) AS due_now,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table} WHERE run_at <= now()
                               LIMIT %(cap)s) AS n) AS due_deferred,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table} WHERE run_at > now()
                               LIMIT %(cap)s) AS n) AS future,
        (SELECT created_at FROM {schema}.{table} WHERE run_at IS NULL ORDER BY id LIMIT 1) AS oldest_now,
        (SELECT min(run_at) FROM {schema}.{table} WHERE run_at <= now()) AS oldest_deferred,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{dead} LIMIT %(cap)s) AS n) AS dead
)
SELECT due_now + due_deferred AS due,
       future,
       due_now + due_deferred + future AS backlog,
       coalesce(extract(epoch FROM now() - least(oldest_now, oldest_deferred)), 0)::float8
           AS oldest_due_age_s,
       dead
FROM parts;

-- name: leader
-- Who holds the leader lock, if anyone.
SELECT a.pid, a.application_name, a.client_addr::text AS client_addr,
       a.backend_start, a.state
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(classid)s AND l.objid = %(objid)s AND l.objsubid = 1;

-- name: table_exists
SELECT to_regclass(%(qualified)s) IS NOT NULL AS present;

-- name: dead_filter
-- A fragment, not a statement: which dead letters a `drain dead` command applies to (a null
-- filter matches everything). The dead_* statements include it by name.
(%(backend)s::text IS NULL OR backend = %(backend)s::text)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(job_name)s::text IS NULL OR job_name = %(job_name)s::text)
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))

-- name: dead_list
-- Dead letters matching the filters, oldest first.
SELECT id, job_id, job_name, job_args, job_kwargs, queue, backend, options, created_at,
       attempts, error, dead_at
FROM {schema}.{dead}
WHERE {dead_filter}
ORDER BY id
LIMIT %(limit)s::bigint;

-- name: dead_retry
-- Move dead letters back to the table as new rows: the same job_id, attempts reset, due now.
-- A job_id already staged again stays dead (and is not counted); one row per job_id moves.
WITH chosen AS (
    SELECT DISTINCT ON (job_id) * FROM (
        SELECT * FROM {schema}.{dead}
        WHERE {dead_filter}
        ORDER BY id
        LIMIT %(limit)s::bigint
        FOR UPDATE
    ) AS matching
    ORDER BY job_id, id DESC
), staged AS (
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, options)
    SELECT job_name, job_args, job_kwargs, queue, backend, job_id, options FROM chosen ORDER BY id
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id
)
DELETE FROM {schema}.{dead} AS d
USING chosen JOIN staged ON staged.job_id = chosen.job_id
WHERE d.id = chosen.id
RETURNING d.id;

-- name: dead_purge
-- Delete dead letters matching the filters.
DELETE FROM {schema}.{dead}
WHERE id IN (
    SELECT id FROM {schema}.{dead}
    WHERE {dead_filter}
    ORDER BY id
    LIMIT %(limit)s::bigint
)
RETURNING id;

-- name: schedule_ticks
-- The last tick of each named schedule, locked: under REPEATABLE READ a concurrent writer of
-- the same rows makes this transaction fail instead of staging a tick twice.
SELECT name, last_tick
FROM {schema}.{schedules}
WHERE name = ANY(%(names)s::text[])
FOR UPDATE;

-- name: schedule_now
-- The database clock, the one every schedule is evaluated against.
SELECT now() AS now;

-- name: schedule_advance
-- Record a schedule's new last tick, only if it still is what this transaction read
-- (%(previous)s, null for a schedule seen for the first time): returns no row otherwise.
INSERT INTO {schema}.{schedules} AS s (name, cron, timezone, last_tick, last_job_id, updated_at)
VALUES (%(name)s, %(cron)s, %(timezone)s, %(last_tick)s, %(last_job_id)s::uuid, now())
ON CONFLICT (name) DO UPDATE
SET cron = excluded.cron,
    timezone = excluded.timezone,
    last_tick = excluded.last_tick,
    last_job_id = coalesce(excluded.last_job_id, s.last_job_id),
    updated_at = now()
WHERE s.last_tick = %(previous)s::timestamptz
RETURNING name;

-- name: schedule_stage
-- Stage the jobs of due ticks (run_at = the tick). A job_id already in the table stays as it
-- is: the id is derived from (schedule, tick), so that would be the same tick.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options
FROM jsonb_to_recordset(%(jobs)s::jsonb) AS j(
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, options jsonb
)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: schedule_list
-- Every schedule the table has a row for, configured or removed, with the database clock.
SELECT name, cron, timezone, last_tick, last_job_id, updated_at, now() AS now
FROM {schema}.{schedules}
ORDER BY name;

-- name: wake_arm
-- The idle leader takes the table's wake lock (see the trigger in schema.sql): from now on every
-- producer's INSERT notifies the channel. Refused while a producer that staged a row without
-- notifying is still open: its commit is about to make a row due, so the leader must not sleep.
-- The key and channel are computed here exactly as the trigger computes them.
SELECT pg_try_advisory_lock(w.wake_key) AS armed,
       'drain_wake_' || to_hex(w.wake_key) AS channel
FROM (SELECT hashtextextended('drain-wake:' || %(schema)s::text || '.' || %(table)s::text, 0)
             AS wake_key) AS w;

-- name: wake_disarm
-- Awake again: producers stop paying for NOTIFY.
SELECT pg_advisory_unlock(hashtextextended('drain-wake:' || %(schema)s::text || '.' || %(table)s::text, 0))
       AS released;

-- name: anything_due
-- After arming, in its own statement (so its snapshot is taken after the lock): is a row due
-- already? Two index probes that stop at the first row: one staged for now (its INSERT fired the
-- trigger), one whose run_at has passed (it fell due: no trigger can announce that).
SELECT EXISTS (SELECT 1 FROM {schema}.{table} WHERE run_at IS NULL) AS staged_now,
       EXISTS (SELECT 1 FROM {schema}.{table} WHERE run_at <= now()) AS fell_due;

-- name: wake_trigger_enabled
-- Whether producers' INSERTs fire the wake-up trigger (missing before `drain migrate`, or
-- disabled with ALTER TABLE ... DISABLE TRIGGER): without it the drain wakes on the poll only.
SELECT EXISTS (
    SELECT 1 FROM pg_trigger
    WHERE tgrelid = to_regclass(%(qualified)s) AND tgname = 'drain_wake' AND tgenabled IN ('O', 'A')
) AS enabled;

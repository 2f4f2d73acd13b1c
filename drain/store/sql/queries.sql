-- Every statement drain runs, as named blocks ("-- name: <name>"), loaded once by drain.store.sql.
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

-- name: try_lock_shared
-- A member of a table with lanes (drain.relay.lanes) holds the leader lock shared: no drain of one
-- lane can lead it meanwhile, and members do not exclude each other.
SELECT pg_try_advisory_lock_shared(%(key)s) AS acquired, pg_backend_pid() AS pid;

-- name: unlock_shared
SELECT pg_advisory_unlock_shared(%(key)s) AS released;

-- name: lane_lock
-- A lane's lock (exclusive: its leader) or a member's count (shared: ``lane`` is
-- drain.relay.lanes.MEMBERS + the lane count it runs with), in the table's own key space.
SELECT CASE WHEN %(shared)s THEN pg_try_advisory_lock_shared(%(space)s::int, %(lane)s::int)
            ELSE pg_try_advisory_lock(%(space)s::int, %(lane)s::int) END AS acquired;

-- name: lane_unlock
SELECT CASE WHEN %(shared)s THEN pg_advisory_unlock_shared(%(space)s::int, %(lane)s::int)
            ELSE pg_advisory_unlock(%(space)s::int, %(lane)s::int) END AS released;

-- name: lane_holders
-- Who holds what in the table's lane key space, in this database: every lane's leader, and every
-- member with the lane count it runs with (drain.relay.lanes); and for how long each holder's
-- session has run no statement (quiet_s: 0 while one runs, null where pg_stat_activity hides it).
SELECT l.pid, l.objid::bigint AS lane, l.mode = 'ShareLock' AS shared,
       CASE WHEN a.state = 'active' THEN 0
            ELSE extract(epoch FROM clock_timestamp() - a.state_change)::float8 END AS quiet_s
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = %(space)s::int::oid
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());

-- name: lanes_held
-- The fence of a batch with lanes (lock_held's, for each lane this drain leads): this session's
-- backend, and how many of ``lanes`` it holds.
SELECT pg_backend_pid() AS pid,
       (SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND mode = 'ExclusiveLock'
          AND classid = %(space)s::int::oid AND objsubid = 2
          AND objid = ANY(%(lanes)s::int[]::oid[])) AS held,
       CASE WHEN %(relaxed)s THEN set_config('synchronous_commit', 'off', true) END AS relaxed;

-- name: due_now
-- A fragment, not a statement: due_rows' rows staged for now (run_at null), walking the due
-- index in id order, the window's bound first (due_rows says why).
SELECT * FROM (SELECT *, xmin AS staged_xmin FROM {schema}.{table}
 WHERE run_at IS NULL AND backend <> ALL(%(paused)s::text[])
   AND id <> ALL(%(exclude)s::bigint[]) AND {not_parked_in_place} AND {in_lanes}
   AND (%(window)s::bigint IS NULL OR id <= coalesce((
       SELECT id FROM {schema}.{table}
       WHERE run_at IS NULL AND backend <> ALL(%(paused)s::text[])
         AND id <> ALL(%(exclude)s::bigint[]) AND {not_parked_in_place} AND {in_lanes}
       ORDER BY id OFFSET %(window)s LIMIT 1), 9223372036854775807))
   AND {key_free}
 ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED) AS due_now

-- name: due_now_lanes
-- A fragment, not a statement: due_now for a member leading ``lanes`` (an array's text) of a
-- table with the lanes index and function of its count (migrations.sql lanes_function), in a
-- select with a window: the same rows, found lane by lane instead of walking every lane's. The
-- function hands back the first window + 1 due rows of those lanes in id order, ids only (as
-- due_now's window, but for the key); they are then locked in id order, the first ``limit`` that
-- no app holds and whose key is free, and no other: the scalar subquery runs the function once,
-- and the lock is taken row by row, in the primary key's order, under the LIMIT. Every test of
-- due_now is made again on those rows (a few hundred at most): whatever the function hands back,
-- the select takes only due rows of the lanes this drain leads.
SELECT * FROM (SELECT *, xmin AS staged_xmin FROM {schema}.{table}
 WHERE id = ANY((SELECT {schema}.{lanes_function}(%(lanes)s::int[], %(window)s::bigint + 1,
                                                  %(paused)s::text[], %(exclude)s::bigint[]))::bigint[])
   AND run_at IS NULL AND backend <> ALL(%(paused)s::text[])
   AND id <> ALL(%(exclude)s::bigint[]) AND {not_parked_in_place} AND {in_lanes}
   AND {key_free}
 ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED) AS due_now

-- name: due_rows
-- A fragment, not a statement: the due rows select_due takes, and how much of them fits a
-- batch, learnt without rendering anything. Due rows in id order: those staged for now
-- (run_at null) and those whose run_at has passed; each branch walks its own index, so a million
-- future rows cost nothing here. ``exclude`` holds the rows of the batch still in flight
-- (published, confirms awaited) in a pipelined loop, and those whose settlement is still to be
-- written (drain.relay.settle.Held). A row parked in place (not_parked_in_place) is never due.
-- FOR UPDATE SKIP LOCKED: a row an app holds a lock on is
-- left for a later batch, so the batch's DELETE never waits for an app's transaction; the rows
-- taken stay locked until the batch commits (an app's UPDATE or DELETE of one of them waits for
-- that commit). Under REPEATABLE READ a row changed and committed since the snapshot fails the
-- statement with 40001 (the relay looks again).
--
-- Two cuts in id order, each over the rows of at most ``max_row_bytes`` (a larger row is never
-- read), each taking a row while the rows before it sum to less than ``chunk_bytes`` (so the
-- first such row always passes):
-- 1. on stored_bytes, the row's size as stored (names' lengths, each JSON value's pg_column_size):
--    read from the row and its toast pointers, nothing fetched from the toast table. A value
--    that compressed well counts for little here, so for the rows within this cut only:
-- 2. on raw_bytes, the same with each JSON value's size once decompressed: ``#> '{{}}'`` (the
--    empty path) hands back the value itself, fetched and decompressed but not rendered, which
--    costs a fraction of rendering it (300 values of 1 MB that compressed to 12 KB: 35 ms, as
--    text 2 s). A row past the first cut keeps its stored size as raw_bytes.
-- ``within``: the row passed both; only such a row's content is ever rendered.
--
-- Each branch looks no further than its first ``window`` + 1 rows (every test but key_free's):
-- a keyed row held back by a lower id of its key is visited and passed over, and without this
-- bound a batch that asked for more rows than there were free keys walked the whole backlog
-- (100 hot keys: 1 s a select over 80,000 rows). The relay widens the window after a select
-- that found nothing (drain.store.reading.Reader), so rows behind a longer run of held rows are
-- reached, a step later.
SELECT measured.*,
       stored_within AND raw_bytes <= %(max_row_bytes)s
       AND raw_running - raw_bytes < %(chunk_bytes)s AS within
FROM (
    SELECT measured.*,
           sum(CASE WHEN stored_within AND raw_bytes <= %(max_row_bytes)s THEN raw_bytes ELSE 0 END)
               OVER (ORDER BY id) AS raw_running
    FROM (
        SELECT stored.*,
               CASE WHEN stored_within
                    THEN octet_length(job_name) + octet_length(queue) + octet_length(backend)
                         + pg_column_size(job_args #> '{{}}') + pg_column_size(job_kwargs #> '{{}}')
                         + pg_column_size(options #> '{{}}')
                    ELSE stored_bytes
               END AS raw_bytes
        FROM (
            SELECT stored.*,
                   stored_bytes <= %(max_row_bytes)s
                   AND stored_running - stored_bytes < %(chunk_bytes)s AS stored_within
            FROM (
                SELECT stored.*,
                       sum(CASE WHEN stored_bytes <= %(max_row_bytes)s THEN stored_bytes ELSE 0 END)
                           OVER (ORDER BY id) AS stored_running
                FROM (
                    SELECT id, job_id, attempts, job_name, queue, backend, job_args, job_kwargs,
                           options, created_at, run_at, staged_xmin, ordering_key,
                           octet_length(job_name) + octet_length(queue) + octet_length(backend)
                           + pg_column_size(job_args) + pg_column_size(job_kwargs)
                           + pg_column_size(options) AS stored_bytes
                    FROM (
                        {due_now}
                        UNION ALL
                        SELECT * FROM (SELECT *, xmin AS staged_xmin FROM {schema}.{table}
                         WHERE run_at <= now() AND backend <> ALL(%(paused)s::text[])
                           AND id <> ALL(%(exclude)s::bigint[]) AND {not_parked_in_place} AND {in_lanes}
                           AND (%(window)s::bigint IS NULL OR (run_at, id) <= (
                               SELECT coalesce(max(bound.run_at), 'infinity'),
                                      coalesce(max(bound.id), 9223372036854775807)
                               FROM (SELECT run_at, id FROM {schema}.{table}
                                     WHERE run_at <= now() AND backend <> ALL(%(paused)s::text[])
                                       AND id <> ALL(%(exclude)s::bigint[]) AND {not_parked_in_place} AND {in_lanes}
                                     ORDER BY run_at, id OFFSET %(window)s LIMIT 1) AS bound))
                           AND {key_free}
                         ORDER BY run_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED) AS fell_due
                        ORDER BY id
                        LIMIT %(limit)s
                    ) AS due
                ) AS stored
            ) AS stored
            OFFSET 0
        ) AS stored
        OFFSET 0
    ) AS measured
) AS measured

-- name: select_due
-- The due rows (due_rows), read so that nothing a row holds can fail this statement or the
-- batch (drain.store.reading decodes each row on its own): JSON comes as text, and a timestamp outside
-- what Python's datetime holds (``earliest`` .. ``latest``) as null, created_at with its text.
-- age_s (drain_commit_to_publish_seconds) runs from the staging transaction's commit when the
-- server records commit times (track_commit_timestamp = on) and the row was never retried, else
-- from created_at, the staging transaction's start.
--
-- Sized before it is sent. Only a row ``within`` due_rows' cuts is rendered as text (a backlog of
-- big rows costs the server what one batch can take, not the whole row cap's text); its
-- row_bytes is then its names and JSON as text, any other row's its raw_bytes. A rendered row's
-- content comes only when its text is within ``max_row_bytes`` and, counted in id order with the
-- rendered rows before it, within ``chunk_bytes`` (the first within ``first_bytes``, so a batch
-- can always take one): text can be longer than the value it renders (escapes), so this last cut
-- bounds what is sent. Any other row comes back with its size and its names cut to
-- ``name_chars`` characters (substr reads no more of a long name than that). OFFSET 0 keeps
-- each layer's expressions (the rendering above all) from being inlined, and so computed twice.
SELECT id, job_id, attempts, row_bytes, sent,
       CASE WHEN sent THEN job_name ELSE substr(job_name, 1, %(name_chars)s) END AS job_name,
       CASE WHEN sent THEN queue ELSE substr(queue, 1, %(name_chars)s) END AS queue,
       CASE WHEN sent THEN backend ELSE substr(backend, 1, %(name_chars)s) END AS backend,
       CASE WHEN sent THEN args_text END AS job_args,
       CASE WHEN sent THEN kwargs_text END AS job_kwargs,
       CASE WHEN sent THEN options_text END AS options,
       CASE WHEN created_readable THEN created_at END AS created_at,
       CASE WHEN NOT created_readable THEN created_at::text END AS created_at_text,
       CASE WHEN run_at BETWEEN %(earliest)s AND %(latest)s THEN run_at END AS run_at,
       CASE WHEN created_readable THEN extract(epoch FROM clock_timestamp() - coalesce(
           CASE WHEN attempts = 0 AND current_setting('track_commit_timestamp') = 'on'
                THEN pg_xact_commit_timestamp(staged_xmin) END,
           created_at))::float8 END AS age_s,
       substr(ordering_key, 1, %(key_chars)s) AS ordering_key
FROM (
    SELECT measured.*,
           within AND row_bytes <= %(max_row_bytes)s
           AND (running_bytes <= %(chunk_bytes)s
                OR (running_bytes = row_bytes AND row_bytes <= %(first_bytes)s)) AS sent,
           created_at BETWEEN %(earliest)s AND %(latest)s AS created_readable
    FROM (
        SELECT measured.*,
               sum(CASE WHEN within AND row_bytes <= %(max_row_bytes)s THEN row_bytes ELSE 0 END)
                   OVER (ORDER BY id) AS running_bytes
        FROM (
            SELECT rendered.*,
                   CASE WHEN within
                        THEN octet_length(job_name) + octet_length(queue) + octet_length(backend)
                             + octet_length(args_text) + octet_length(kwargs_text)
                             + octet_length(options_text)
                        ELSE raw_bytes
                   END AS row_bytes
            FROM (
                SELECT due.*,
                       CASE WHEN within THEN job_args::text END AS args_text,
                       CASE WHEN within THEN job_kwargs::text END AS kwargs_text,
                       CASE WHEN within THEN options::text END AS options_text
                FROM ({due_rows}) AS due
                OFFSET 0
            ) AS rendered
        ) AS measured
    ) AS measured
) AS chosen
ORDER BY id;

-- name: delete_ids
-- Delete exactly these rows, each matched by its id *and* its job_id: an id reused since the row
-- was read (an app's OVERRIDING SYSTEM VALUE, a restarted identity) is another job, never
-- published. Its row count is checked (Batch.delete): a trigger returning NULL, a rule or a
-- row-level security policy can leave a row in place without an error.
-- The setting it sets for this transaction: the wake-up trigger on DELETE leaves the drain's own
-- settlement alone (functions.sql drain_wake_freed). Set in a test that refers to no row (run once,
-- before any row is read), so it is set whether or not any of the rows is still there.
DELETE FROM {schema}.{table} AS t
USING unnest(%(ids)s::bigint[], %(job_ids)s::uuid[]) AS k(id, job_id)
WHERE (SELECT set_config('drain.settling', 'on', true)) = 'on'
  AND t.id = k.id AND t.job_id = k.job_id;

-- name: present_ids
-- Which of these rows (id and job_id) are still in the table: after a settlement statement that
-- changed fewer rows than asked, those left in place were refused; the others an app deleted.
SELECT t.id FROM {schema}.{table} AS t
JOIN unnest(%(ids)s::bigint[], %(job_ids)s::uuid[]) AS k(id, job_id)
  ON t.id = k.id AND t.job_id = k.job_id;

-- name: park
-- A row whose settlement the table refused (its DELETE, its burial) is parked: run_at far in the
-- future (drain.store.writes.PARKED_AT), so no select takes it again, and why in last_error, starting
-- with drain.store.writes.PARKED_PREFIX. Matched by id and job_id like every settlement statement.
UPDATE {schema}.{table} SET run_at = %(parked_at)s, last_error = %(error)s
WHERE id = %(id)s AND job_id = %(job_id)s;

-- name: park_in_place
-- A row whose parking the table refused too (an app's CHECK on run_at, a trigger on it) is parked
-- in place: run_at untouched, why in last_error, starting with drain.store.writes.PARKED_IN_PLACE_PREFIX,
-- which every statement that looks for due rows skips (not_parked_in_place).
UPDATE {schema}.{table} SET last_error = %(error)s
WHERE id = %(id)s AND job_id = %(job_id)s;

-- name: not_parked_in_place
-- A fragment, not a statement: the row is not parked in place (park_in_place). Every statement
-- that looks for due rows (due_rows, status, anything_due) includes it, so they agree; its
-- prefix is drain.store.writes.PARKED_IN_PLACE_PREFIX (a unit test checks). A filter on the row, not
-- an index condition: each due branch still walks its index, and a row parked in place costs
-- a select the visit of its row.
(last_error IS NULL OR left(last_error, 23) <> 'drain: parked in place:')

-- name: lane_of
-- A fragment, not a statement: a row's lane (drain.relay.lanes). A function of what the row was
-- staged with, which never changes: its ordering key (the same key, the same lane) or, without
-- one, its job id, hashed by the server (every drain computes it alike) modulo the table's
-- ``lane_count``.
mod(hashtext(coalesce(ordering_key, job_id::text)) & 2147483647, %(lane_count)s::int)

-- name: in_lanes
-- A fragment, not a statement: the row belongs to one of the lanes this drain leads
-- (lane_of). ``other_lanes`` null: one lane, every row (the test is folded away at planning).
--
-- Written as "in none of the lanes others lead" (``other_lanes``: every lane this drain does not
-- lead), not "= ANY(the lanes it leads)": the planner knows nothing of the hash, and guesses 0.5%
-- of the rows for each lane of an ``= ANY`` (2 lanes of 8: 1% where a quarter pass). With that
-- guess it walked the whole table and sorted it for the window's bound (2 lanes of 8, 100,000
-- rows: 200 ms a select instead of 15), and priced the walk high enough to JIT-compile the
-- statement. ``<> ALL`` of the others is guessed to keep most rows: the index walk in id order.
(%(other_lanes)s::int[] IS NULL OR {lane_of} <> ALL(%(other_lanes)s::int[]))

-- name: key_free
-- A fragment, not a statement: the row's ordering key does not hold it back. A keyed row is due
-- only when no other row of its key with a lower id is in the table, whatever that row's state
-- (waiting for its retry, deferred, parked, locked by an app, in flight in a pipelined batch and
-- its confirm awaited, settled but not yet deleted): so a batch holds at most one row per key, and
-- a row goes only after the one before it was acknowledged and deleted. With ``dead_blocking``
-- (the backends with block_on_dead_letter), a keyed row of such a backend also waits while a dead
-- letter of its key exists. One probe of the key index per keyed row visited; a row without a key
-- pays one test. In an OR, so the planner keeps it a per-row filter under the LIMIT rather than an
-- anti-join over the whole table. The outer table is referred to by its own name: a statement
-- using this fragment reads the table without an alias.
(ordering_key IS NULL OR (
    NOT EXISTS (SELECT 1 FROM {schema}.{table} AS ahead
                WHERE ahead.ordering_key = {table}.ordering_key AND ahead.id < {table}.id)
    AND (backend <> ALL(%(dead_blocking)s::text[])
         OR NOT EXISTS (SELECT 1 FROM {schema}.{dead} AS dead
                        WHERE dead.ordering_key = {table}.ordering_key))))

-- name: parked_count
-- The rows parked by park, for `drain status` (the run_at index): the run_at marker *and* the
-- drain's prefix in last_error, so a job an app staged for 9000-01-01 is not counted as parked;
-- and those parked in place (park_in_place), found among the due rows (each due index walked).
SELECT (SELECT count(*) FROM {schema}.{table}
        WHERE run_at = %(parked_at)s AND left(last_error, length(%(prefix)s)) = %(prefix)s)
       + (SELECT count(*) FROM {schema}.{table} WHERE run_at IS NULL AND NOT {not_parked_in_place})
       + (SELECT count(*) FROM {schema}.{table} WHERE run_at <= now() AND NOT {not_parked_in_place})
       AS parked;

-- name: held_ids
-- Which of these rows another transaction holds a lock on right now: not waited for (SKIP LOCKED),
-- the others stay locked by this transaction until it ends. Before writing a settlement for rows
-- an earlier transaction published, when one was found held (limit_lock_wait) or was held last
-- time: a row an app holds is settled by a later step instead of stalling this one.
WITH mine AS (
    SELECT id FROM {schema}.{table} WHERE id = ANY(%(ids)s::bigint[]) FOR UPDATE SKIP LOCKED
)
SELECT id FROM {schema}.{table}
WHERE id = ANY(%(ids)s::bigint[]) AND id NOT IN (SELECT id FROM mine);

-- name: limit_lock_wait
-- For the rest of this transaction: a lock wait longer than this fails (55P03) instead of waiting
-- for the statement timeout. Before settling rows published by an earlier transaction, which an
-- app may hold: the relay then writes the settlement again in a fresh transaction (held_ids).
SELECT set_config('lock_timeout', %(ms)s, true) AS lock_timeout;

-- name: fire_deferred
-- Run the deferred constraint triggers of the statements so far now, and those of the rest of the
-- transaction at each statement, not at COMMIT: a probe (rolled back to its savepoint) must see a
-- deferred trigger that would refuse it, and a settlement written row by row must meet the
-- refusal at the row's own statement.
SET CONSTRAINTS ALL IMMEDIATE;

-- name: lock_for_writes
-- The lock every settlement write takes on the table (and, for a burial, on the dead letters),
-- taken in a savepoint under a bounded lock_timeout: refused, the table itself is locked against
-- writes (LOCK TABLE, a CREATE INDEX, an ALTER TABLE), whichever rows a settlement names.
LOCK TABLE {schema}.{table} IN ROW EXCLUSIVE MODE;

-- name: lock_dead_for_writes
LOCK TABLE {schema}.{dead} IN ROW EXCLUSIVE MODE;

-- name: can_insert
-- Whether this role may INSERT into the table: then a probe writes a row of its own.
SELECT has_table_privilege(to_regclass(%(table)s), 'INSERT') AS can_insert;

-- name: probe_row
-- A row of the drain's own, in a savepoint the probe rolls back (Batch.test_table): the table's
-- default for every value but its name and job_id, due now. Its id is given, a random negative
-- one, so the probe takes no value of the identity (ids keep their order and their reuse after a
-- restart). No RETURNING: a row-level security policy that hides it from SELECT would refuse the
-- INSERT itself; probe_row_id asks whether the drain's SELECT sees it.
INSERT INTO {schema}.{table} (id, job_name, job_id) OVERRIDING SYSTEM VALUE
VALUES (%(id)s, %(job_name)s, %(job_id)s::uuid);

-- name: probe_row_id
SELECT id FROM {schema}.{table} WHERE job_id = %(job_id)s::uuid;

-- name: settle_check
-- Can this session settle what it would publish? A standby (in recovery) or a read-only session
-- can read the table and take "the" advisory lock (locks are per server), but not delete: it must
-- not lead. The privileges are those of a settlement: SELECT, UPDATE (a failed row's backoff) and
-- DELETE on the table, SELECT and INSERT on the dead-letter table; and SELECT on the versions
-- table, which says whether the table has the schema those settlements are written for. A
-- table that does not exist lacks nothing here (the relay's own check says to migrate).
-- row_security: whether row-level security policies apply to this role on the table (enabled,
-- and the role neither owns the table without FORCE nor has BYPASSRLS): rows they hide from its
-- SELECT are never forwarded.
SELECT pg_is_in_recovery() AS in_recovery,
       current_setting('transaction_read_only') = 'on' AS read_only,
       current_user::text AS role,
       ARRAY(SELECT p FROM unnest(%(table_privileges)s::text[]) AS p
             WHERE NOT has_table_privilege(to_regclass(%(table)s), p)) AS table_missing,
       ARRAY(SELECT p FROM unnest(%(dead_privileges)s::text[]) AS p
             WHERE NOT has_table_privilege(to_regclass(%(dead)s), p)) AS dead_missing,
       ARRAY(SELECT p FROM unnest(%(versions_privileges)s::text[]) AS p
             WHERE NOT has_table_privilege(to_regclass(%(versions)s), p)) AS versions_missing,
       coalesce(row_security_active(to_regclass(%(table)s)), false) AS row_security;

-- name: record_failures
-- One UPDATE for every failed row of a batch: attempts, last error, and when to try again. The
-- rows it returns are those it changed (a trigger or a policy can skip one without an error).
UPDATE {schema}.{table} AS t
SET attempts = t.attempts + f.counted,
    last_error = f.error,
    run_at = now() + make_interval(secs => f.delay_s)
FROM unnest(%(ids)s::bigint[], %(job_ids)s::uuid[], %(counted)s::int[], %(errors)s::text[],
            %(delays)s::float8[]) AS f(id, job_id, counted, error, delay_s)
WHERE t.id = f.id AND t.job_id = f.job_id
RETURNING t.id;

-- name: bury
-- Copy rows to the dead-letter table with their error, in the batch's transaction; Batch.bury
-- then deletes exactly the rows copied (delete_ids), both in one savepoint, and checks the
-- counts: a trigger or a rule on either table can skip a row without an error, and a row deleted
-- but not buried would be lost. Two statements, not one with a data-modifying WITH: PostgreSQL
-- refuses that on a table with a DO ALSO rule on DELETE (an archive rule). Nothing the
-- dead-letter table holds can refuse them (no key on the row's id; dead_id is generated), and
-- attempts saturates rather than overflow on a row staged with attempts at the integer maximum.
-- Returns the staged rows copied, by id and job_id.
INSERT INTO {schema}.{dead}
    (id, job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, created_at,
     attempts, last_error, error, ordering_key)
SELECT t.id, t.job_name, t.job_args, t.job_kwargs, t.queue, t.backend, t.job_id, t.run_at, t.options,
       t.created_at, CASE WHEN t.attempts < 2147483647 THEN t.attempts + 1 ELSE t.attempts END,
       f.error, f.error, t.ordering_key
FROM {schema}.{table} AS t
JOIN unnest(%(ids)s::bigint[], %(job_ids)s::uuid[], %(errors)s::text[]) AS f(id, job_id, error)
  ON t.id = f.id AND t.job_id = f.job_id
RETURNING id, job_id;

-- name: seconds_until_due
-- How long until the earliest future row falls due, so an idle leader can wake for it. Measured
-- on the database's clock: the drain's own clock may be skewed. A run_at of 'infinity' never
-- falls due (and Postgres cannot subtract it).
SELECT extract(epoch FROM min(run_at) - clock_timestamp())::float8 AS seconds
FROM {schema}.{table} WHERE run_at > now() AND run_at < 'infinity';

-- name: set_timeouts
-- The session's timeouts, SET after connecting (a startup ``options`` parameter can be dropped
-- silently by a pooler) and read back by ``session_timeouts``, where this server has them:
-- idle_session_timeout (PostgreSQL 14+) is the drain's own, longer than its longest silence
-- (drain.store.connection.idle_session_timeout_ms), so a role's or database's value cannot cut an idle
-- leader and a frozen one loses its session (and the lock); transaction_timeout (17+) is off, as
-- a role's value would end a long term. The server's TCP keepalives and tcp_user_timeout on this
-- session's socket are brought down to the drain's (a shorter value the server has stays; 0 is
-- the system's default), so a leader cut off by the network is found out on the server's side too.
-- The formats psycopg reads are set too, whatever a role, a database or PGDATESTYLE /
-- PGCLIENTENCODING chose: DateStyle ISO (psycopg cannot read timestamptz in another: every batch
-- failed), IntervalStyle postgres, and client_encoding UTF8 (in LATIN1, one row holding a
-- character LATIN1 lacks failed every select; SQL_ASCII stays SQL_ASCII, read by
-- drain.store.connection._Utf8TextLoader).
SELECT set_config('DateStyle', 'ISO, MDY', false) AS datestyle,
       set_config('IntervalStyle', 'postgres', false) AS intervalstyle,
       set_config('client_encoding', CASE current_setting('server_encoding')
                                     WHEN 'SQL_ASCII' THEN 'SQL_ASCII' ELSE 'UTF8' END, false)
           AS client_encoding,
       set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, false),
       (SELECT count(set_config(name, CASE name WHEN 'idle_session_timeout'
                                        THEN %(idle_session_timeout)s ELSE '0' END, false))
        FROM pg_settings WHERE name IN ('idle_session_timeout', 'transaction_timeout')) AS timeouts,
       (SELECT count(set_config(name, wanted, false))
        FROM pg_settings
        JOIN (VALUES ('tcp_keepalives_idle', %(keepalives_idle)s),
                     ('tcp_keepalives_interval', %(keepalives_interval)s),
                     ('tcp_keepalives_count', %(keepalives_count)s),
                     ('tcp_user_timeout', %(tcp_user_timeout)s)) AS drain (name, wanted) USING (name)
        WHERE setting::bigint = 0 OR setting::bigint > wanted::bigint) AS keepalives;

-- name: session_timeouts
-- In milliseconds, whatever unit they were set in; NULL for a setting this server does not have.
SELECT (SELECT setting FROM pg_settings WHERE name = 'statement_timeout')::bigint
           AS statement_timeout,
       (SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout')::bigint
           AS idle_timeout,
       (SELECT setting FROM pg_settings WHERE name = 'idle_session_timeout')::bigint
           AS idle_session_timeout,
       (SELECT setting FROM pg_settings WHERE name = 'transaction_timeout')::bigint
           AS transaction_timeout;

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
-- or the earliest passed run_at (since it fell due). An infinite time (which Postgres cannot
-- subtract) counts as none: such a row is read (refused or forwarded) at the next step. A row
-- parked in place is not due (parked_count counts it).
WITH parts AS (
    SELECT
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table}
                               WHERE run_at IS NULL AND {not_parked_in_place}
                               LIMIT %(cap)s) AS n) AS due_now,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table}
                               WHERE run_at <= now() AND {not_parked_in_place}
                               LIMIT %(cap)s) AS n) AS due_deferred,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{table} WHERE run_at > now()
                               LIMIT %(cap)s) AS n) AS future,
        (SELECT CASE WHEN isfinite(created_at) THEN created_at END FROM {schema}.{table}
         WHERE run_at IS NULL AND {not_parked_in_place} ORDER BY id LIMIT 1) AS oldest_now,
        (SELECT min(run_at) FROM {schema}.{table}
         WHERE run_at <= now() AND run_at > '-infinity' AND {not_parked_in_place}) AS oldest_deferred,
        (SELECT count(*) FROM (SELECT 1 FROM {schema}.{dead} LIMIT %(cap)s) AS n) AS dead
)
SELECT due_now + due_deferred AS due,
       future,
       due_now + due_deferred + future AS backlog,
       coalesce(extract(epoch FROM now() - least(oldest_now, oldest_deferred)), 0)::float8
           AS oldest_due_age_s,
       dead
FROM parts;

-- name: blocked
-- The due rows their ordering key holds back (key_free: a lower id of the key is still in the
-- table, or a dead letter of it under block_on_dead_letter), for `drain status` and the leader's
-- gauges: how many, over how many keys, and the oldest (its age as the status query's lag: since
-- created_at, or since its run_at passed), with the first row of its key (null: a dead letter
-- holds it). Capped as the status query: each branch walks its due index in the select's order
-- and stops after %(cap)s due rows (NULL: all of them), one probe of the key index for each keyed
-- row among them (the leader's gauges look at fewer rows than it counts: metrics.KEY_COUNT_CAP). A table
-- without a keyed row costs one probe of the (empty) key index: the walks never start (a probe
-- in key order, so that it is planned on the key index, never as a scan of the table).
WITH due_now AS (
    SELECT id, ordering_key, CASE WHEN isfinite(created_at) THEN created_at END AS since,
           NOT {key_free} AS held
    FROM {schema}.{table}
    WHERE run_at IS NULL AND {not_parked_in_place}
      AND (SELECT keyed.ordering_key FROM {schema}.{table} AS keyed
           WHERE keyed.ordering_key IS NOT NULL ORDER BY keyed.ordering_key LIMIT 1) IS NOT NULL
    ORDER BY id LIMIT %(cap)s
), fell_due AS (
    SELECT id, ordering_key, CASE WHEN isfinite(run_at) THEN run_at END AS since,
           NOT {key_free} AS held
    FROM {schema}.{table}
    WHERE run_at <= now() AND {not_parked_in_place}
      AND (SELECT keyed.ordering_key FROM {schema}.{table} AS keyed
           WHERE keyed.ordering_key IS NOT NULL ORDER BY keyed.ordering_key LIMIT 1) IS NOT NULL
    ORDER BY run_at, id LIMIT %(cap)s
), held AS (
    SELECT id, ordering_key, since FROM due_now WHERE held
    UNION ALL
    SELECT id, ordering_key, since FROM fell_due WHERE held
), oldest AS (
    SELECT id, ordering_key, since FROM held ORDER BY since NULLS LAST, id LIMIT 1
)
SELECT (SELECT count(*) FROM held) AS blocked,
       (SELECT count(DISTINCT ordering_key) FROM held) AS blocked_keys,
       oldest.id AS oldest_blocked_id,
       oldest.ordering_key AS oldest_blocked_key,
       coalesce(extract(epoch FROM now() - oldest.since), 0)::float8 AS oldest_blocked_age_s,
       (SELECT min(ahead.id) FROM {schema}.{table} AS ahead
        WHERE ahead.ordering_key = oldest.ordering_key AND ahead.id < oldest.id) AS oldest_blocked_behind
FROM (SELECT 1) AS one LEFT JOIN oldest ON true;

-- name: leader
-- Who holds the leader lock exclusively, if anyone: the table's one leader. With lanes, every
-- member holds it shared (drain.relay.lanes) and none of them is "the" leader (lane_sessions).
SELECT a.pid, a.application_name, a.client_addr::text AS client_addr,
       a.backend_start, a.state
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %(classid)s AND l.objid = %(objid)s AND l.objsubid = 1;

-- name: lane_backlog
-- Each lane's due rows (lane_of, over ``lane_count`` lanes), for `drain status` and the gauges
-- of lane 0's leader: how many, and the age of the oldest (the status query's lag, per lane). One
-- grouped statement, capped as the status query: each branch walks its due index in the select's
-- order and stops after %(cap)s rows (NULL: all of them), so a lane missing among those has no
-- row older than the last row walked. ``deferred`` says how many came from the run_at branch:
-- a branch that reached the cap (here, summed over the lanes) was cut.
WITH due AS (
    (SELECT ordering_key, job_id, false AS deferred,
            CASE WHEN isfinite(created_at) THEN created_at END AS since
     FROM {schema}.{table}
     WHERE run_at IS NULL AND {not_parked_in_place}
     ORDER BY id LIMIT %(cap)s)
    UNION ALL
    (SELECT ordering_key, job_id, true AS deferred,
            CASE WHEN isfinite(run_at) THEN run_at END AS since
     FROM {schema}.{table}
     WHERE run_at <= now() AND {not_parked_in_place}
     ORDER BY run_at, id LIMIT %(cap)s)
)
SELECT {lane_of} AS lane,
       count(*) AS due,
       count(*) FILTER (WHERE deferred) AS deferred,
       coalesce(extract(epoch FROM now() - min(since)), 0)::float8 AS oldest_due_age_s
FROM due
GROUP BY 1
ORDER BY 1;

-- name: lane_sessions
-- Who holds what in the table's lane key space (lane_holders), with each holder's session as
-- `drain status` names it (drain.store.identity).
SELECT l.pid, l.objid::bigint AS lane, l.mode = 'ShareLock' AS shared,
       a.application_name, a.client_addr::text AS client_addr, a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = %(space)s::int::oid
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.pid, l.objid;

-- name: set_application_name
-- The leader's lock session says since when it leads (drain.store.identity); status reads it back.
SELECT set_config('application_name', %(name)s, false) AS application_name;

-- name: drains
-- Every drain process connected to this database (drain.store.identity names its sessions).
SELECT DISTINCT application_name FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'drain/%';

-- name: table_exists
SELECT to_regclass(%(qualified)s) IS NOT NULL AS present;

-- name: dead_filter
-- A fragment, not a statement: which dead letters a `drain dead` command applies to (a null
-- filter matches everything; ids are dead letters' own, dead_id). The dead_* statements include
-- it by name.
(%(backend)s::text IS NULL OR backend = %(backend)s::text)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(job_name)s::text IS NULL OR job_name = %(job_name)s::text)
  AND (%(ids)s::bigint[] IS NULL OR dead_id = ANY(%(ids)s::bigint[]))
  AND (%(ordering_key)s::text IS NULL OR ordering_key = %(ordering_key)s::text)
  AND (%(since)s::timestamptz IS NULL OR dead_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR dead_at < %(until)s::timestamptz)
  AND (%(upto)s::bigint IS NULL OR dead_id <= %(upto)s::bigint)
  -- A text search's term that holds one of the process's own secrets (the pages hide them,
  -- redaction.hide; the statement never sees them): nothing matches.
  AND NOT %(hidden_term)s::boolean
  -- The text searches (error, arg) are the candidate walk's (dead_candidates): any other statement
  -- given one matches nothing (drain.store.admin first turns them into the dead letters they
  -- match, by dead_id).
  AND ((%(error)s::text IS NULL AND %(arg)s::text IS NULL) OR %(searching)s::boolean)


-- name: dead_agreed
-- A fragment, not a statement: how many dead letters match (n), and whether the set an operator
-- confirmed still matches (agreed): %(confirmed)s, as many; %(digest)s (dead_extent's digest of
-- the set it counted), the same ones. Either null: not checked (`drain dead retry|purge`).
    SELECT n, (%(confirmed)s::bigint IS NULL OR n = %(confirmed)s::bigint)
              AND (%(digest)s::text IS NULL OR digest = %(digest)s::text) AS agreed
    FROM (
        SELECT count(*) AS n,
               encode(sha256(convert_to(coalesce(string_agg(dead_id::text, ',' ORDER BY dead_id)
                                                 FILTER (WHERE %(digest)s::text IS NOT NULL), ''),
                                        'UTF8')), 'hex') AS digest
        FROM (
            SELECT dead_id FROM {schema}.{dead} WHERE {dead_filter} ORDER BY dead_id LIMIT %(limit)s::bigint
        ) AS matching
    ) AS counted


-- name: dead_list
-- Dead letters matching the filters, oldest first.
SELECT dead_id, id AS row_id, job_id, job_name, job_args, job_kwargs, queue, backend, options,
       created_at, attempts, error, dead_at, ordering_key
FROM {schema}.{dead}
WHERE {dead_filter}
ORDER BY dead_id
LIMIT %(limit)s::bigint;

-- name: dead_matching
-- A dead-letter page's walk (the console's) under no text search: the dead letters numbered %(upto)s and below, newest
-- first, at most %(scan)s of them (NULL: all); those of them matching the filters, counted up to
-- %(cap)s (the walk stops there); the dead_id of the newest %(limit)s of those; and the number of
-- the newest dead letter the walk did not reach (NULL: it could reach them all), where the next
-- walk starts. So a filter many match costs a bounded read, and one few match reads at most
-- %(scan)s dead letters (the caller bounds the text filters so: each must read every row). The
-- bound is a range of dead_id, not a LIMIT under the filters, so that an index serves them (the
-- ordering key's).
WITH bound AS (
    SELECT CASE WHEN %(scan)s::bigint IS NOT NULL THEN (
        SELECT dead_id FROM {schema}.{dead}
        WHERE %(upto)s::bigint IS NULL OR dead_id <= %(upto)s::bigint
        ORDER BY dead_id DESC OFFSET %(scan)s::bigint LIMIT 1) END AS unreached
), matching AS (
    SELECT dead_id FROM {schema}.{dead}
    WHERE {dead_filter}
      AND dead_id >= coalesce((SELECT unreached FROM bound) + 1, -9223372036854775808)
    ORDER BY dead_id DESC
    LIMIT %(cap)s
)
SELECT (SELECT count(*) FROM matching) AS matching,
       coalesce((SELECT (array_agg(dead_id ORDER BY dead_id DESC))[1:%(limit)s] FROM matching), '{{}}')
           AS newest,
       (SELECT unreached FROM bound) AS unreached;

-- name: dead_scan_bound
-- Where a dead-letter page's walk under a text search stops: the number of the newest dead letter,
-- numbered %(upto)s and below, beyond the newest %(scan)s of them (none: it reaches them all).
SELECT dead_id FROM {schema}.{dead}
WHERE %(upto)s::bigint IS NULL OR dead_id <= %(upto)s::bigint
ORDER BY dead_id DESC OFFSET %(scan)s::bigint LIMIT 1;

-- name: dead_candidates
-- The text searches (the console's): a plain substring (no LIKE pattern) of what a page shows,
-- the error any case, a key or a value among the arguments (at any depth). What a page shows is
-- the stored text with some pieces replaced by *** (drain.observability.redaction), so a term
-- without a * that the stored text lacks cannot match it (for the arguments: their JSON text
-- holds the term's JSON, escaping being character by character; any case where a URL stands, as
-- a page shows its scheme in lower case): a cheap test passes over the other rows. Where no
-- masking can touch a row (touched_*: no URL, no "password" or "pwd", no word of a secret's name, none of
-- the process's own secrets %(hidden)s), what is shown is what is stored, and the test here is
-- exact (settled; for the arguments, a walk of their keys and values); the other rows Python
-- decides on what a page shows (drain.store.admin), given the error as a list shows it (dead_page:
-- redacted here first) and the arguments, only while those before come to less than %(bytes)s
-- bytes, their arguments' and (under the error filter) their error's (within: Python stops at
-- the first beyond; the first is always within; none beyond comes with its error or arguments).
-- The dead letters dead_filter takes, numbered above %(floor)s, newest first, at most %(cap)s
-- (NULL: all). No index serves them; the caller bounds them (statement_timeout). The JSON text
-- is made once a row (OFFSET 0: not inlined).
WITH term AS (  -- the arguments' term as their JSON text holds it
    SELECT substr(quoted, 2, length(quoted) - 2) AS json
    FROM (SELECT to_jsonb(%(arg)s::text)::text AS quoted) AS whole
)
SELECT dead_id, settled,
       CASE WHEN NOT settled AND %(error)s::text IS NOT NULL AND within
            THEN regexp_replace(regexp_replace(error, %(url_password)s, %(url_mask)s, 'g'),
                                %(pair_password)s, %(pair_mask)s, 'gi') END AS error,
       CASE WHEN NOT settled AND %(arg)s::text IS NOT NULL AND within THEN job_args END AS job_args,
       CASE WHEN NOT settled AND %(arg)s::text IS NOT NULL AND within THEN job_kwargs END AS job_kwargs,
       within, size
FROM (
    SELECT *, %(bytes)s::bigint IS NULL
              OR sum(CASE WHEN settled THEN 0 ELSE size END) OVER (ORDER BY dead_id DESC)
                 - CASE WHEN settled THEN 0 ELSE size END < %(bytes)s::bigint
              AS within
    FROM (
        SELECT dead_id, error, job_args, job_kwargs, size,
               NOT coalesce(touched_error, false) AND NOT coalesce(touched_args, false) AS settled
        FROM (
            SELECT dead_id, error, job_args, job_kwargs, args_text,
                   strpos(lower(error), lower(%(error)s::text)) > 0 AS error_holds,
                   strpos(args_text, (SELECT json FROM term)) > 0 AS args_hold,
                   -- what Python is handed: the arguments' text, not their stored (compressed) size
                   coalesce(octet_length(args_text), 0)
                   + CASE WHEN %(error)s::text IS NOT NULL THEN octet_length(error) ELSE 0 END AS size,
                   CASE WHEN %(error)s::text IS NOT NULL THEN
                       strpos(error, '://') > 0
                       OR translate(error, %(folded)s, %(folded_to)s) ~* %(pair_word)s
                       OR EXISTS (SELECT FROM unnest(%(hidden)s::text[]) AS secret
                                  WHERE strpos(error, secret) > 0) END AS touched_error,
                   CASE WHEN %(arg)s::text IS NOT NULL THEN
                       strpos(args_text, '://') > 0
                       -- a secret's name whatever separates its words (redaction.is_secret_name),
                       -- in a key, or a password= / Pwd= pair in a value: the JSON's escapes dropped
                       -- (a key's newline is \n there), then all but letters and digits
                       OR regexp_replace(regexp_replace(translate(args_text, %(folded)s, %(folded_to)s),
                                                        %(json_escape)s, '', 'g'),
                                         %(normal_drop)s, '', 'g') ~* %(secret_words)s
                       OR EXISTS (SELECT FROM unnest(%(hidden)s::text[]) AS secret
                                  WHERE strpos(args_text, substr(to_jsonb(secret)::text, 2,
                                                                 length(to_jsonb(secret)::text) - 2)) > 0)
                       END AS touched_args
            FROM {schema}.{dead},
                 LATERAL (SELECT CASE WHEN %(arg)s::text IS NOT NULL
                                      THEN job_args::text || ' ' || job_kwargs::text END AS args_text
                          OFFSET 0) AS made
            WHERE {dead_filter}
              AND (%(floor)s::bigint IS NULL OR dead_id > %(floor)s::bigint)
              AND (%(error)s::text IS NULL OR strpos(lower(error), lower(%(error)s::text)) > 0
                   OR strpos(%(error)s::text, '*') > 0)
              AND (%(arg)s::text IS NULL OR strpos(args_text, (SELECT json FROM term)) > 0
                   OR strpos(%(arg)s::text, '*') > 0 OR strpos(args_text, '://') > 0)
            ORDER BY dead_id DESC
            OFFSET 0
        ) AS held
        WHERE (%(error)s::text IS NULL OR error_holds OR touched_error)
          AND (%(arg)s::text IS NULL
               OR CASE WHEN args_hold THEN touched_args OR EXISTS (
               WITH RECURSIVE walk(key, value) AS (
                   SELECT NULL::text, job_args
                   UNION ALL SELECT NULL::text, job_kwargs
                   UNION ALL
                   SELECT child.key, child.value
                   FROM walk, LATERAL (
                       SELECT member.key, member.value
                       FROM jsonb_each(CASE WHEN jsonb_typeof(walk.value) = 'object' THEN walk.value END)
                            AS member
                       UNION ALL
                       SELECT walk.key, item.value
                       FROM jsonb_array_elements(CASE WHEN jsonb_typeof(walk.value) = 'array'
                                                      THEN walk.value END) AS item(value)
                   ) AS child)
               SELECT FROM walk
               WHERE strpos(key, %(arg)s::text) > 0
                  OR (jsonb_typeof(value) NOT IN ('object', 'array')
                      AND strpos(CASE WHEN jsonb_typeof(value) = 'string' THEN value #>> ARRAY[]::text[]
                                      ELSE value::text END, %(arg)s::text) > 0))
                       WHEN strpos(%(arg)s::text, '*') > 0 OR NOT touched_args THEN touched_args
                       ELSE strpos(lower(args_text), lower((SELECT json FROM term))) > 0
                  END)
        ORDER BY dead_id DESC
        LIMIT %(cap)s::bigint
    ) AS taken
) AS counted
ORDER BY dead_id DESC;

-- name: dead_any_case
-- Whether each of %(texts)s holds %(term)s, any case as dead_filter compares an error.
SELECT strpos(lower(shown), lower(%(term)s::text)) > 0
FROM unnest(%(texts)s::text[]) WITH ORDINALITY AS each(shown, n)
ORDER BY n;

-- name: dead_extent
-- How many dead letters match the filters, the highest dead_id among them, and the digest of
-- their set (the sha256, in hex, of their dead_id in order, comma-separated; drain.store.admin
-- computes the same in Python): the console's confirmation binds its action to them (upto,
-- confirmed: dead_retry takes none unless the same set matches).
SELECT count(*), coalesce(max(dead_id), 0),
       encode(sha256(convert_to(coalesce(string_agg(dead_id::text, ',' ORDER BY dead_id), ''), 'UTF8')), 'hex')
FROM {schema}.{dead} WHERE {dead_filter};

-- name: dead_page
-- Dead letters matching the filters, newest first, each text cut to %(cut)s characters, so a page
-- costs the same whatever a row holds (the error redacted before it is cut: a cut inside a URL's
-- password would leave a prefix no pattern finds; and cut to %(error_cut)s, for Python to hide the
-- process's own secrets before its cut, drain.store.admin); arguments whole up to %(args_bytes)s bytes of JSON (so
-- that their secrets can be masked), else null with their size (a 2 MB value is not read out).
SELECT dead_id, job_id, left(job_name, %(cut)s) AS job_name, left(queue, %(cut)s) AS queue,
       left(backend, %(cut)s) AS backend, left(ordering_key, %(cut)s) AS ordering_key, attempts,
       CASE WHEN isfinite(dead_at) THEN dead_at END AS dead_at,
       left(regexp_replace(regexp_replace(error, %(url_password)s, %(url_mask)s, 'g'),
                           %(pair_password)s, %(pair_mask)s, 'gi'), %(error_cut)s) AS error,
       CASE WHEN pg_column_size(job_args) <= %(args_bytes)s THEN job_args END AS job_args,
       CASE WHEN pg_column_size(job_kwargs) <= %(args_bytes)s THEN job_kwargs END AS job_kwargs,
       pg_column_size(job_args) + pg_column_size(job_kwargs) AS args_bytes
FROM {schema}.{dead}
WHERE {dead_filter}
ORDER BY dead_id DESC
LIMIT %(limit)s::bigint;

-- name: queue_backlog
-- The staged rows per backend and queue, due or scheduled, over at most %(cap)s rows (the lowest
-- ids: the oldest), so the figure costs a bounded walk of the primary key on any table.
SELECT backend, queue,
       count(*) FILTER (WHERE run_at IS NULL OR run_at <= now()) AS due,
       count(*) FILTER (WHERE run_at > now()) AS scheduled,
       count(*) FILTER (WHERE attempts > 0) AS retrying
FROM (SELECT backend, queue, run_at, attempts FROM {schema}.{table} ORDER BY id LIMIT %(cap)s) AS oldest
GROUP BY backend, queue
ORDER BY backend, queue;

-- name: estimates
-- The planner's estimate of the rows of the table and of its dead letters (pg_class.reltuples,
-- kept by ANALYZE and autovacuum; -1 before either ran): what a page says beyond its counts' cap.
SELECT (SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%(table)s)) AS staged,
       (SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%(dead)s)) AS dead;

-- name: limit_statements
-- An operator's page bounds its statements below the drain's statement_timeout (a text search).
-- No JIT: a text filter's walk of the arguments is planned at a cost that starts it, and its
-- compiling took longer than the scan it was meant to speed up (0.8 s for 0.25 s).
SELECT set_config('statement_timeout', %(ms)s, false), set_config('jit', 'off', false);

-- name: may_act
-- Whether this session can retry and purge dead letters: a primary that takes writes, and a role
-- that may insert into the table and delete from the dead letters (and read both).
SELECT NOT pg_is_in_recovery() AS primary,
       current_setting('transaction_read_only') = 'off' AS writable,
       has_table_privilege(%(table)s, 'INSERT') AND has_table_privilege(%(dead)s, 'SELECT, DELETE')
           AS privileged;

-- name: dead_ids
-- The ids of the dead letters matching the filters, newest first (a retry one at a time).
SELECT dead_id FROM (
    SELECT dead_id FROM {schema}.{dead}
    WHERE {dead_filter}
    ORDER BY dead_id
    LIMIT %(limit)s::bigint
) AS matching
ORDER BY dead_id DESC;

-- name: dead_retry
-- Move dead letters back to the table: the same job_id and key, attempts reset, due now. A row
-- without a key is a new row (a new id: it goes to the end); a keyed one takes its own id back,
-- so it goes back in its place among the rows of its key still staged (due_rows), unless the
-- table's identity was restarted below it (identity). A job_id already staged again, or a keyed
-- row's id taken meanwhile, stays dead (and is not counted); one row per job_id moves.
-- Racing another command (READ COMMITTED, drain.store.admin): a dead letter another transaction
-- holds (a retry, a purge) is skipped, not waited for, and counted in matched but not locked.
-- One row: moved, matched (the filter's, as the statement began), locked (this one took).
-- With %(confirmed)s (the count an operator confirmed) and %(digest)s (the digest of the set it
-- counted, dead_extent's): unless as many match, and the same ones (their digest), the set changed
-- since the count (one gone and one numbered below its bound committed after it, say), and the
-- statement takes none (agreed: false); its caller says so. One statement, one snapshot: the
-- count and the set are the act's. Either null: not checked (`drain dead retry`).
WITH matched AS ({dead_agreed}), locked AS (
    SELECT * FROM {schema}.{dead}
    WHERE {dead_filter}
      AND (SELECT agreed FROM matched)
    ORDER BY dead_id
    LIMIT %(limit)s::bigint
    FOR UPDATE SKIP LOCKED
), chosen AS (
    SELECT DISTINCT ON (job_id) * FROM locked
    ORDER BY job_id, dead_id DESC
), identity AS (
    -- The highest id the table's identity has handed out (0: none yet). An id above it is one
    -- the identity will hand out again (it was restarted): taken back, it would fail that
    -- producer's INSERT, so such a keyed row is staged again under a new id instead, at the end.
    SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence(%(qualified)s, 'id')::regclass), 0) AS last
), renewed AS (
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, options)
    SELECT job_name, job_args, job_kwargs, queue, backend, job_id, options
    FROM chosen WHERE ordering_key IS NULL ORDER BY dead_id
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id
), in_place AS (
    INSERT INTO {schema}.{table}
        (id, job_name, job_args, job_kwargs, queue, backend, job_id, options, ordering_key)
    OVERRIDING SYSTEM VALUE
    SELECT id, job_name, job_args, job_kwargs, queue, backend, job_id, options, ordering_key
    FROM chosen WHERE ordering_key IS NOT NULL AND id <= (SELECT last FROM identity) ORDER BY dead_id
    ON CONFLICT DO NOTHING
    RETURNING job_id
), renewed_keyed AS (
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, options, ordering_key)
    SELECT job_name, job_args, job_kwargs, queue, backend, job_id, options, ordering_key
    FROM chosen WHERE ordering_key IS NOT NULL AND id > (SELECT last FROM identity) ORDER BY dead_id
    ON CONFLICT (job_id) DO NOTHING
    RETURNING job_id
), staged AS (
    SELECT job_id FROM renewed UNION ALL SELECT job_id FROM in_place
    UNION ALL SELECT job_id FROM renewed_keyed
), moved AS (
    DELETE FROM {schema}.{dead} AS d
    USING chosen JOIN staged ON staged.job_id = chosen.job_id
    WHERE d.dead_id = chosen.dead_id
    RETURNING d.dead_id
)
SELECT (SELECT count(*) FROM moved) AS moved, (SELECT n FROM matched) AS matched,
       (SELECT count(*) FROM locked) AS locked, (SELECT agreed FROM matched) AS agreed;

-- name: dead_purge
-- Delete dead letters matching the filters. Racing another command (READ COMMITTED,
-- drain.store.admin): a dead letter another transaction holds is skipped, not waited for. One
-- row: purged, keyed (whether rows of a key may be waiting on them), matched (the filter's, as
-- the statement began), agreed. With %(confirmed)s and %(digest)s: none taken unless the same set
-- matches (dead_retry).
WITH matched AS ({dead_agreed}), locked AS (
    SELECT dead_id FROM {schema}.{dead}
    WHERE {dead_filter}
      AND (SELECT agreed FROM matched)
    ORDER BY dead_id
    LIMIT %(limit)s::bigint
    FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM {schema}.{dead}
    WHERE dead_id IN (SELECT dead_id FROM locked)
    RETURNING ordering_key
)
SELECT count(*) AS purged, coalesce(bool_or(ordering_key IS NOT NULL), false) AS keyed,
       (SELECT n FROM matched) AS matched, (SELECT agreed FROM matched) AS agreed
FROM purged;

-- name: wake_due
-- Wake a sleeping leader: rows became due that no INSERT or UPDATE announced (a purged dead letter
-- of a key held its rows under block_on_dead_letter). Changes no row, yet fires the statement
-- trigger drain_wake_due (functions.sql: AFTER UPDATE OF run_at, last_error, once per statement,
-- whatever the rows), which notifies the leader at commit if it sleeps.
UPDATE {schema}.{table} SET run_at = run_at WHERE false;

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
-- is and returns no row: schedule_tick_rows then says whether that row is the same tick.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options
FROM jsonb_to_recordset(%(jobs)s::jsonb) AS j(
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, options jsonb
)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: schedule_tick_rows
-- Of these ticks' jobs (whose job_id a staged row already holds), those whose row is that very
-- tick: the same name, arguments, queue, backend and options, due at the tick or moved since by
-- a failure's backoff (attempts > 0, which a producer cannot set under producer-role.sql). A
-- tick's id is derived from (table, schedule, tick), so anyone can stage a row under it first;
-- such a row is not the tick, and the tick is staged under a fresh id (drain.relay.schedules).
SELECT j.job_id
FROM jsonb_to_recordset(%(jobs)s::jsonb) AS j(
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, options jsonb
)
JOIN {schema}.{table} AS t ON t.job_id = j.job_id
WHERE t.job_name = j.job_name AND t.job_args = j.job_args AND t.job_kwargs = j.job_kwargs
  AND t.queue = j.queue AND t.backend = j.backend AND t.options = j.options
  AND (t.run_at = j.run_at OR t.attempts > 0);

-- name: schedule_list
-- Every schedule the table has a row for, configured or removed, with the database clock.
SELECT name, cron, timezone, last_tick, last_job_id, updated_at, now() AS now
FROM {schema}.{schedules}
ORDER BY name;

-- name: listen
-- The idle leader listens on the table's wake-up channel (wake_arm's; an identifier, not a
-- parameter: LISTEN takes none).
LISTEN {channel};

-- name: ping
-- The readiness probe's question (drain.store.connection.database_probe): does the database answer?
SELECT 1;

-- name: wake_arm
-- The idle leader takes a wake lock of the table (see the triggers in functions.sql): from now on
-- every producer's INSERT notifies the channel. Refused while a producer that staged a row without
-- notifying is still open: its commit is about to make a row due, so the leader must not sleep.
-- With lanes (``slots`` > 1: drain_wake_v2) each idle member sleeps holding a slot of its own, the
-- first one free; ``slot`` null: every slot refused. The keys and the channel are computed here
-- exactly as the trigger computes them (slot 0's key is the one wake lock of a table without lanes).
SELECT (SELECT slot FROM generate_series(0, %(slots)s::int - 1) AS slot
        WHERE pg_try_advisory_lock(hashtextextended(w.wake_name, slot)) LIMIT 1) AS slot,
       'drain_wake_' || to_hex(hashtextextended(w.wake_name, 0)) AS channel
FROM (SELECT 'drain-wake:' || %(schema)s::text || '.' || %(table)s::text AS wake_name) AS w;

-- name: wake_disarm
-- Awake again: producers stop paying for NOTIFY (once no member sleeps).
SELECT pg_advisory_unlock(hashtextextended('drain-wake:' || %(schema)s::text || '.' || %(table)s::text,
                                           %(slot)s::int)) AS released;

-- name: anything_due
-- After arming, in its own statement (so its snapshot is taken after the lock): is a row due
-- already? Two index probes that stop at the first row: one staged for now (its INSERT fired the
-- trigger), one whose run_at has passed (it fell due: no trigger can announce that). And the
-- seconds until the earliest future row falls due (null: none), on the database's clock: a row
-- committed after the leader last asked, but before it armed, notified nobody, so the sleep is
-- capped by this. A run_at of 'infinity' never falls due (and Postgres cannot subtract it); a row
-- parked in place, or held back by its ordering key (key_free), is not due (the leader would
-- never sleep): each probe walks its index in order past such rows (an EXISTS with that filter
-- may be planned as a scan of the whole table), and no further than the select's window
-- (``window``, due_rows): a key held with a long run of rows cost every arming a walk of the run
-- (100,000 rows: 1 s). A row behind a longer run is then found by the poll or a select that
-- looks at every row (drain.store.reading.FULL_EVERY). The window's rows are read under the
-- table's own name, which key_free refers to.
SELECT (SELECT id FROM (SELECT id, ordering_key, backend FROM {schema}.{table}
                        WHERE run_at IS NULL AND {not_parked_in_place} AND {in_lanes}
                        ORDER BY id LIMIT %(window)s) AS {table}
        WHERE {key_free} LIMIT 1) IS NOT NULL AS staged_now,
       (SELECT id FROM (SELECT id, ordering_key, backend FROM {schema}.{table}
                        WHERE run_at <= now() AND {not_parked_in_place} AND {in_lanes}
                        ORDER BY run_at, id LIMIT %(window)s) AS {table}
        WHERE {key_free} LIMIT 1) IS NOT NULL AS fell_due,
       extract(epoch FROM (SELECT min(run_at) FROM {schema}.{table}
                           WHERE run_at > now() AND run_at < 'infinity')
                          - clock_timestamp())::float8 AS next_due_s;

-- name: wake_trigger_enabled
-- Whether producers' INSERTs fire the wake-up trigger (missing before `drain migrate`, or
-- disabled with ALTER TABLE ... DISABLE TRIGGER): without it the drain wakes on the poll only.
-- And its wake slots (functions.sql drain_wake_v2's argument; drain_wake_v1: one).
SELECT coalesce(bool_or(tgenabled IN ('O', 'A')), false) AS enabled,
       coalesce(max(substring(pg_get_triggerdef(oid), 'drain_wake_v2\(''([0-9]+)''\)')::int), 1) AS slots
FROM pg_trigger
WHERE tgrelid = to_regclass(%(qualified)s) AND tgname = 'drain_wake';

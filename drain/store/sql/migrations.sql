-- The statements of drain.store.migrations around the schema files: the versions table, what the
-- catalog says, and the validation of the constraints added NOT VALID.
-- {{version}}, {{description}}, {{index}} and the like are filled by drain.store.migrations.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

-- name: lock_timeout
SET LOCAL lock_timeout = {lock_timeout};

-- name: no_statement_timeout
-- For the migrating session: checking the rows of a big table may take minutes.
SELECT set_config('statement_timeout', '0', false);

-- name: state
-- Which of the table's pieces exist; without a versions table, an existing table is version 1.
SELECT to_regclass({qualified_table}) IS NOT NULL AS has_table,
       to_regclass({qualified_dead}) IS NOT NULL AS has_dead,
       to_regclass({qualified_versions}) IS NOT NULL AS has_versions;

-- name: version
SELECT max(version) AS version FROM {schema}.{versions};

-- name: versions_table
-- One row per schema version applied to this table, and when and by which drain.
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.{versions} (
    version       integer     PRIMARY KEY,
    description   text        NOT NULL,
    drain_version text        NOT NULL,
    applied_at    timestamptz NOT NULL DEFAULT now()
);

-- name: record_version
INSERT INTO {schema}.{versions} (version, description, drain_version)
VALUES ({version}, {description}, {drain_version})
ON CONFLICT (version) DO NOTHING;

-- name: fresh_guard
-- For a printed fresh install (`drain migrate --print`): refuse to run over an older table,
-- whose CREATE ... IF NOT EXISTS would change nothing while the version says otherwise.
DO $drain$
DECLARE
    recorded integer;
BEGIN
    IF to_regclass({qualified_table}) IS NULL AND to_regclass({qualified_dead}) IS NULL THEN
        RETURN;
    END IF;
    IF to_regclass({qualified_versions}) IS NOT NULL THEN
        EXECUTE pg_catalog.format('SELECT max(version) FROM %s', {qualified_versions}) INTO recorded;
    END IF;
    IF recorded IS DISTINCT FROM {version} THEN
        RAISE EXCEPTION 'drain: % already exists at an older schema version; upgrade it with the output of `drain migrate --print --from N` (N: its version) or with `drain migrate`',
            {qualified_table};
    END IF;
END;
$drain$;

-- name: upgrade_guard
-- For a printed upgrade (`drain migrate --print --from N`): the table must exist.
DO $drain$
BEGIN
    IF to_regclass({qualified_table}) IS NULL OR to_regclass({qualified_dead}) IS NULL THEN
        RAISE EXCEPTION 'drain: % does not exist; create it with the output of `drain migrate --print`',
            {qualified_table};
    END IF;
END;
$drain$;

-- name: validate
-- Validate the table's constraints added NOT VALID (SHARE UPDATE EXCLUSIVE: producers and the
-- drain go on while the rows are read). A step moves the rows that break its constraint first,
-- and rows staged meanwhile were checked at INSERT, so this fails only on a row that step could
-- not see; the constraint then stays NOT VALID (reported, and tried again by the next `drain
-- migrate`). Their names are kept in this transaction's setting ``drain.not_valid``.
DO $drain$
DECLARE
    pending record;
    not_valid text[] := '{{}}';
BEGIN
    FOR pending IN
        SELECT conname FROM pg_catalog.pg_constraint
        WHERE conrelid = {qualified_table}::regclass AND contype = 'c' AND NOT convalidated
          AND conname LIKE 'drain\_%'
        ORDER BY conname
    LOOP
        BEGIN
            EXECUTE pg_catalog.format('ALTER TABLE %s VALIDATE CONSTRAINT %I', {qualified_table}, pending.conname);
        EXCEPTION WHEN check_violation OR invalid_parameter_value THEN
            not_valid := not_valid || pending.conname::text;
        END;
    END LOOP;
    PERFORM pg_catalog.set_config('drain.not_valid', pg_catalog.array_to_string(not_valid, ','), true);
END;
$drain$;

-- name: validate_result
SELECT coalesce(current_setting('drain.not_valid', true), '') AS not_valid;

-- name: not_valid
-- The table's own constraints still NOT VALID (for `drain check`).
SELECT conname::text AS name FROM pg_catalog.pg_constraint
WHERE conrelid = {qualified_table}::regclass AND contype = 'c' AND NOT convalidated
  AND conname LIKE 'drain\_%'
ORDER BY conname;

-- name: index_invalid
-- An index a CREATE INDEX CONCURRENTLY left behind when it failed: IF NOT EXISTS would keep it.
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_index i
    WHERE i.indexrelid = to_regclass({qualified_index}) AND NOT i.indisvalid
) AS invalid;

-- name: lanes_index
-- The lanes index of a table with lanes (drain.relay.lanes), for one lane count: each lane's rows
-- due now in id order, so a member reads its own lanes' rows and none of the others'
-- (lanes_function). Its expression is queries.sql lane_of with the count as a constant, the
-- form the planner matches. An expression index: no table rewrite, and every staging path gets
-- it. Built CONCURRENTLY (producers and drains go on; it waits for the transactions open when it
-- starts) by `drain migrate` with the drains' lanes setting.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {schema}.{table} (({lane_of}), id) WHERE run_at IS NULL;

-- name: lanes_function
-- The first rows due now of each lane in $1, at most $2 in all, in id order: the ids only, no
-- row locked (queries.sql due_now_lanes locks them). A row of a paused backend ($3), in flight
-- ($4) or parked in place is not among them, as in due_now's window. Each lane's rows come from
-- its own part of the lanes index (lanes_index), and the planner is told to read it so for this
-- function alone (its SET clauses last until it returns, so an app's trigger later in the
-- batch's transaction is planned as the app's session says): with statistics taken when the
-- table was empty (a drained table, then a backlog) it chose a bitmap scan of each whole lane and
-- a sort, or a sequential scan; jit off, as a plan priced that way would be compiled. The body
-- (lanes_function_body) is a string literal: no quoting tag a table's name could end.
CREATE OR REPLACE FUNCTION {schema}.{function}(int[], bigint, text[], bigint[])
RETURNS bigint[] LANGUAGE sql STABLE
SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off
AS {body};

-- name: lanes_function_body
SELECT coalesce(array_agg(merged.id ORDER BY merged.id), '{{}}')
FROM (SELECT lane_first.id
      FROM unnest($1) AS mine(lane),
           LATERAL (SELECT id FROM {schema}.{table}
                    WHERE run_at IS NULL AND {lane_of} = mine.lane
                      AND backend <> ALL($3) AND id <> ALL($4) AND {not_parked_in_place}
                    ORDER BY id LIMIT $2) AS lane_first
      ORDER BY lane_first.id LIMIT $2) AS merged

-- name: lanes_ready
-- What Store.lanes_index_problem needs: whether the lanes index for a count is there and valid
-- (not left invalid by a failed build), whether its function is there and this session may run
-- it with its own rights, the function's body and settings (compared with what this drain
-- creates), and its version (another after every CREATE OR REPLACE, ALTER or GRANT).
SELECT coalesce((SELECT i.indisvalid FROM pg_catalog.pg_index i
                 WHERE i.indexrelid = to_regclass({qualified_index})), false) AS index_valid,
       p.oid IS NOT NULL AS function_there,
       coalesce(has_function_privilege(p.oid, 'EXECUTE') AND NOT p.prosecdef, false) AS runnable,
       p.prosrc AS body, p.proconfig AS settings, p.oid::bigint || ':' || p.xmin::text AS version
FROM (SELECT to_regprocedure({qualified_function} || '(int[], bigint, text[], bigint[])')::oid AS oid) AS f
LEFT JOIN pg_catalog.pg_proc AS p ON p.oid = f.oid;

-- name: lanes_plan_settings
-- lanes_plan's: no path but an index's order (sorts cost as much as the planner can price).
SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_sort = off; SET LOCAL enable_incremental_sort = off;

-- name: lanes_plan
-- Whether the lanes index gives each lane's rows due now in id order, whatever the table's size
-- and statistics: with sorts priced out (lanes_plan_settings) the planner reads an index in that
-- order when one gives it (Store.lanes_index_problem looks for an index read, nothing sorted).
-- An index of that name but another definition (expression, columns, predicate) gives no such
-- order, and the plan sorts.
EXPLAIN (FORMAT JSON)
SELECT id FROM {schema}.{table} WHERE run_at IS NULL ORDER BY ({lane_of}), id LIMIT 1;

-- name: drop_index
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index};

-- name: lock
-- One migration at a time, whatever the table (the key of drain 0.1.0's migrate). Tried, and tried
-- again after a pause (drain.store.migrations.upgrade), not waited for in one statement: a
-- CREATE INDEX CONCURRENTLY of the migration holding it waits for every older snapshot, that
-- statement's too, and the two would deadlock.
SELECT pg_try_advisory_lock(hashtext('drain:migrate')) AS acquired;

-- name: wait_lock
-- The same lock, waited for in one statement (a migration inside a transaction: Django's).
SELECT pg_advisory_lock(hashtext('drain:migrate'));

-- name: unlock
SELECT pg_advisory_unlock(hashtext('drain:migrate'));

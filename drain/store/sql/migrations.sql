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

-- name: drop_index
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index};

-- name: lock
-- One migration at a time, whatever the table (the key of drain 0.1.0's migrate).
SELECT pg_advisory_lock(hashtext('drain:migrate'));

-- name: unlock
SELECT pg_advisory_unlock(hashtext('drain:migrate'));

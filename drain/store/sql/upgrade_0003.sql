-- Schema version 3, from version 2 (drain 0.2.0): an ordering key on each row. Run by
-- drain.store.migrations block by block, as upgrade_0002.sql says; every block is idempotent.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

-- name: lock_ordering_key
-- A nullable column without a default: a catalog change only, no rewrite of either table. The
-- constraint NOT VALID under the brief lock; every row already there has no key, and the
-- validation after the steps (migrations.sql validate) only reads them.
DO $drain$
BEGIN
    ALTER TABLE {schema}.{table} ADD COLUMN IF NOT EXISTS ordering_key text NULL;
    ALTER TABLE {schema}.{dead} ADD COLUMN IF NOT EXISTS ordering_key text NULL;
    IF NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_constraint
        WHERE conrelid = {qualified_table}::regclass AND conname = 'drain_key_check'
    ) THEN
        ALTER TABLE {schema}.{table} ADD CONSTRAINT drain_key_check
            CHECK (ordering_key IS NULL OR {schema}.drain_key_check_v1(ordering_key) IS NULL) NOT VALID;
    END IF;
END;
$drain$;

-- name: concurrently_key_index
CREATE INDEX CONCURRENTLY IF NOT EXISTS {key_index} ON {schema}.{table} (ordering_key, id)
    WHERE ordering_key IS NOT NULL;

-- name: concurrently_dead_key_index
CREATE INDEX CONCURRENTLY IF NOT EXISTS {dead_key_index} ON {schema}.{dead} (ordering_key)
    WHERE ordering_key IS NOT NULL;

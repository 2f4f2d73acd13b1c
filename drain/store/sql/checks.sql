-- What no backend can carry, in one place: the table's constraint drain_job_check calls this
-- function, drain_stage_v1 calls it before inserting, and `drain migrate` calls it to find the rows
-- already there that break it. drain.stage() (drain/staging/rows.py) refuses the same in Python.
-- A function rather than plain CHECK expressions: PostgreSQL prepares each CHECK expression again
-- for every INSERT statement, which made six of them cost a single-row INSERT about 15% (pgbench);
-- one call of a function, whose own plan is cached per session, costs next to nothing.
-- Versioned by name, like drain_stage_v1: constraints depend on what it accepts, so different
-- rules become drain_job_check_v2 (and a constraint of its own), never a change to v1.
-- `drain migrate` runs this file before the schema (CREATE OR REPLACE: idempotent).
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

-- The bounds: names not blank (ASCII whitespace) and at most 1024 bytes (four times the longest
-- name AMQP carries, far beyond any dotted path or queue name); times in [1970, 9999) UTC, which
-- every backend and Python's datetime carry in any time zone (an AMQP timestamp starts in 1970);
-- attempts not negative; the JSON columns of the right type. NULL: no problem. With refuse (the
-- default) a problem raises 22023 (invalid_parameter_value) naming the column; without, it is
-- returned.
CREATE OR REPLACE FUNCTION {schema}.drain_job_check_v1(
    job_name   text,
    job_args   jsonb,
    job_kwargs jsonb,
    queue      text,
    backend    text,
    run_at     timestamptz,
    options    jsonb,
    created_at timestamptz,
    attempts   integer,
    refuse     boolean DEFAULT true
) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    problem text;
BEGIN
    -- The common case in one expression.
    IF octet_length(job_name) <= 1024 AND pg_catalog.btrim(job_name, E' \t\n\r\f\x0b') <> ''
       AND pg_catalog.jsonb_typeof(job_args) = 'array' AND pg_catalog.jsonb_typeof(job_kwargs) = 'object'
       AND octet_length(queue) <= 1024 AND pg_catalog.btrim(queue, E' \t\n\r\f\x0b') <> ''
       AND octet_length(backend) <= 1024 AND pg_catalog.btrim(backend, E' \t\n\r\f\x0b') <> ''
       AND (run_at IS NULL OR (run_at >= '1970-01-01 00:00:00+00' AND run_at < '9999-01-01 00:00:00+00'))
       AND pg_catalog.jsonb_typeof(options) = 'object'
       AND created_at >= '1970-01-01 00:00:00+00' AND created_at < '9999-01-01 00:00:00+00'
       AND attempts >= 0 THEN
        RETURN NULL;
    END IF;
    IF job_name IS NULL OR octet_length(job_name) > 1024 OR pg_catalog.btrim(job_name, E' \t\n\r\f\x0b') = '' THEN
        problem := pg_catalog.format('job_name must be a non-empty string (not blank, at most 1024 bytes), not %s',
                                     coalesce(pg_catalog.quote_literal(pg_catalog.left(job_name, 80)), 'NULL'));
    ELSIF pg_catalog.jsonb_typeof(job_args) IS DISTINCT FROM 'array' THEN
        problem := 'job_args must be a JSON array, not ' || coalesce(pg_catalog.jsonb_typeof(job_args), 'NULL');
    ELSIF pg_catalog.jsonb_typeof(job_kwargs) IS DISTINCT FROM 'object' THEN
        problem := 'job_kwargs must be a JSON object, not ' || coalesce(pg_catalog.jsonb_typeof(job_kwargs), 'NULL');
    ELSIF queue IS NULL OR octet_length(queue) > 1024 OR pg_catalog.btrim(queue, E' \t\n\r\f\x0b') = '' THEN
        problem := 'queue must be a non-empty string (not blank, at most 1024 bytes)';
    ELSIF backend IS NULL OR octet_length(backend) > 1024 OR pg_catalog.btrim(backend, E' \t\n\r\f\x0b') = '' THEN
        problem := 'backend must be a non-empty string (not blank, at most 1024 bytes)';
    ELSIF run_at < '1970-01-01 00:00:00+00' OR run_at >= '9999-01-01 00:00:00+00' THEN
        problem := 'run_at must be from 1970-01-01 to before 9999-01-01 (UTC), not ' || run_at::text;
    ELSIF pg_catalog.jsonb_typeof(options) IS DISTINCT FROM 'object' THEN
        problem := 'options must be a JSON object, not ' || coalesce(pg_catalog.jsonb_typeof(options), 'NULL');
    ELSIF created_at IS NULL OR created_at < '1970-01-01 00:00:00+00' OR created_at >= '9999-01-01 00:00:00+00' THEN
        problem := 'created_at must be from 1970-01-01 to before 9999-01-01 (UTC), not ' || coalesce(created_at::text, 'NULL');
    ELSE
        problem := 'attempts must not be negative, not ' || coalesce(attempts::text, 'NULL');
    END IF;
    IF refuse THEN
        RAISE EXCEPTION 'drain: %', problem USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN problem;
END;
$$;

-- The ordering key (queries.sql due_rows): not blank and at most 255 bytes, the longest AMQP
-- routing key (the RabbitMQ backend can route by it), when there is one. Its own function and
-- constraint (drain_key_check), added by schema version 3 beside drain_job_check, which never
-- changes; the constraint calls it only for a row that has a key.
CREATE OR REPLACE FUNCTION {schema}.drain_key_check_v1(
    ordering_key text,
    refuse       boolean DEFAULT true
) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF ordering_key IS NULL
       OR (octet_length(ordering_key) <= 255 AND pg_catalog.btrim(ordering_key, E' \t\n\r\f\x0b') <> '') THEN
        RETURN NULL;
    END IF;
    IF refuse THEN
        RAISE EXCEPTION 'drain: ordering_key must be a non-empty string (not blank, at most 255 bytes), not %',
            pg_catalog.quote_literal(pg_catalog.left(ordering_key, 80)) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN 'ordering_key must be a non-empty string (not blank, at most 255 bytes)';
END;
$$;

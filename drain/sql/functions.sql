-- The SQL API for apps in any language: one call stages one job, in the caller's transaction.
-- Versioned by name: a later, different signature becomes a new function (..._v2) beside this
-- one, so a deployed app's calls keep working. CREATE OR REPLACE keeps `drain migrate` idempotent.
-- The checks are drain.stage()'s (drain/staging_rows.py): a bad job raises 22023
-- (invalid_parameter_value) with a message naming the argument, before anything is inserted.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

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
    IF job_name IS NULL OR job_name ~ '^\s*$' THEN
        RAISE EXCEPTION 'drain: job_name must be a non-empty string, not %', coalesce(quote_literal(job_name), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(job_args) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'drain: job_args must be a JSON array, not %', coalesce(jsonb_typeof(job_args), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(job_kwargs) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'drain: job_kwargs must be a JSON object, not %', coalesce(jsonb_typeof(job_kwargs), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(options) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'drain: options must be a JSON object, not %', coalesce(jsonb_typeof(options), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF queue IS NULL OR queue ~ '^\s*$' THEN
        RAISE EXCEPTION 'drain: queue must be a non-empty string' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF backend IS NULL OR backend ~ '^\s*$' THEN
        RAISE EXCEPTION 'drain: backend must be a non-empty string' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF run_at IS NOT NULL AND delay_s IS NOT NULL THEN
        RAISE EXCEPTION 'drain: give run_at or delay_s, not both' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- NaN compares above every number in Postgres, so this refuses NaN and both infinities.
    IF delay_s IS NOT NULL AND NOT (delay_s >= 0 AND delay_s <= 3162240000) THEN
        RAISE EXCEPTION 'drain: delay_s must be between 0 and 3162240000 seconds, not %', delay_s
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO {schema}.{table} (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
    VALUES (job_name, job_args, job_kwargs, queue, backend, new_id,
            coalesce(now() + make_interval(secs => delay_s), run_at), options);
    RETURN new_id;
END;
$$;

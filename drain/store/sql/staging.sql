-- Statements of drain.stage()/stage_many() beyond the plain inserts of queries.sql.
-- Literal braces are doubled because this text goes through psycopg.sql.SQL.format.

-- name: insert_job_if_absent
-- on_conflict="ignore": a job_id already staged (committed, or by a transaction that then
-- commits) inserts nothing and returns no row.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
VALUES (%(job_name)s, %(job_args)s::jsonb, %(job_kwargs)s::jsonb, %(queue)s, %(backend)s,
        %(job_id)s::uuid,
        coalesce(now() + make_interval(secs => %(delay_s)s::float8), %(run_at)s::timestamptz),
        %(options)s::jsonb)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: insert_jobs_if_absent
-- Many jobs, one statement; returns the job_ids actually inserted.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id,
       coalesce(now() + make_interval(secs => delay_s), run_at), options
FROM jsonb_to_recordset(%(jobs)s::jsonb) AS j(
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, delay_s float8, options jsonb
)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: insert_keyed_job
-- The same inserts for jobs with an ordering key (the four insert_keyed_* blocks). Only these
-- name the column: a producer role granted INSERT on the columns of a release before
-- ordering_key stages unkeyed jobs with the statements above as before, and a row without a key
-- costs what it always did.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key)
VALUES (%(job_name)s, %(job_args)s::jsonb, %(job_kwargs)s::jsonb, %(queue)s, %(backend)s,
        %(job_id)s::uuid,
        coalesce(now() + make_interval(secs => %(delay_s)s::float8), %(run_at)s::timestamptz),
        %(options)s::jsonb, %(ordering_key)s::text);

-- name: insert_keyed_job_if_absent
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key)
VALUES (%(job_name)s, %(job_args)s::jsonb, %(job_kwargs)s::jsonb, %(queue)s, %(backend)s,
        %(job_id)s::uuid,
        coalesce(now() + make_interval(secs => %(delay_s)s::float8), %(run_at)s::timestamptz),
        %(options)s::jsonb, %(ordering_key)s::text)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: insert_keyed_jobs
-- In the list's order (WITH ORDINALITY ... ORDER BY, which the plan gets for free): the ids are
-- handed out in that order, so jobs of one key in one call keep the order of the list.
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id,
       coalesce(now() + make_interval(secs => delay_s), run_at), options, ordering_key
FROM ROWS FROM (jsonb_to_recordset(%(jobs)s::jsonb) AS (
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, delay_s float8, options jsonb, ordering_key text
)) WITH ORDINALITY AS j(job_name, job_args, job_kwargs, queue, backend, job_id, run_at, delay_s,
                        options, ordering_key, position)
ORDER BY position;

-- name: insert_keyed_jobs_if_absent
INSERT INTO {schema}.{table}
    (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key)
SELECT job_name, job_args, job_kwargs, queue, backend, job_id,
       coalesce(now() + make_interval(secs => delay_s), run_at), options, ordering_key
FROM ROWS FROM (jsonb_to_recordset(%(jobs)s::jsonb) AS (
    job_name text, job_args jsonb, job_kwargs jsonb, queue text, backend text, job_id uuid,
    run_at timestamptz, delay_s float8, options jsonb, ordering_key text
)) WITH ORDINALITY AS j(job_name, job_args, job_kwargs, queue, backend, job_id, run_at, delay_s,
                        options, ordering_key, position)
ORDER BY position
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

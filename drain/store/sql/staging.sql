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

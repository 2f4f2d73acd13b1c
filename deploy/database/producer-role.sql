-- A producer role's privileges: stage jobs, by plain INSERT, drain_stage_v1(), drain_stage_v2() or
-- drain.stage(), and nothing more (README "Security"). Run as the owner of the table, after
-- `drain migrate`, once per schema/table pair, for each role that stages jobs (an application's
-- own role too);
-- a role made for it beforehand: CREATE ROLE producer LOGIN PASSWORD '...';
-- INSERT is granted column by column: not `id` (with it a producer could INSERT ... OVERRIDING
-- SYSTEM VALUE an id of its choosing, taking ids the identity hands out later), nor what the
-- database or the drain writes: `created_at` (the lag figures), `attempts` and `last_error`.
-- ordering_key: for jobs staged with a key (drain_stage_v2 names the column on every call); a
-- role granted the columns before it existed still stages unkeyed jobs with drain.stage() and
-- drain_stage_v1().
-- The REVOKE first: a table-wide INSERT granted earlier would still cover every column.
REVOKE ALL ON public.staged_jobs FROM producer;
GRANT USAGE ON SCHEMA public TO producer;
GRANT INSERT (job_name, job_args, job_kwargs, queue, backend, job_id, run_at, options, ordering_key) ON public.staged_jobs TO producer;
-- ON CONFLICT (job_id) reads the key: drain.stage(..., on_conflict="ignore") and stage_many's.
-- It shows which job ids are staged, nothing else of a row.
GRANT SELECT (job_id) ON public.staged_jobs TO producer;

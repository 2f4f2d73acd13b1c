-- The drain role's privileges: exactly what `drain run` needs, and nothing more (README "Database
-- setup"). Run as the owner of the tables, after `drain migrate`, once per schema/table pair; the
-- role itself is made beforehand: CREATE ROLE drain LOGIN PASSWORD '...';
-- The drain owns nothing, creates nothing, and EXECUTEs no function beyond PostgreSQL's defaults
-- for PUBLIC (pg_try_advisory_lock and friends).
GRANT USAGE ON SCHEMA public TO drain;
GRANT SELECT, UPDATE, DELETE ON public.staged_jobs TO drain;
GRANT SELECT, INSERT, DELETE ON public.staged_jobs_dead TO drain;
GRANT SELECT ON public.staged_jobs_versions TO drain;
-- Optional (needed with [[schedules]]): INSERT on the table lets the drain test it with a row of its
-- own, rolled back, before leading and when a settlement is refused (README "Settlement failures").
-- GRANT INSERT ON public.staged_jobs TO drain;
-- With lanes (lanes = N), `drain migrate` creates the lanes function <table>_lanesN_due, which
-- PUBLIC may EXECUTE by default. Where default privileges revoke that, grant it (else each drain
-- walks every lane's rows, and says so):
-- GRANT EXECUTE ON FUNCTION public.staged_jobs_lanes8_due(int[], bigint, text[], bigint[]) TO drain;
-- The schedule ticks (<table>_schedules), once your version of drain creates that table.
DO $$
BEGIN
    IF to_regclass('public.staged_jobs_schedules') IS NOT NULL THEN
        GRANT SELECT, INSERT, UPDATE ON public.staged_jobs_schedules TO drain;
    END IF;
END
$$;

"""Schema versions (drain.store.migrations): a table of drain 0.1.0's schema (tests/fixtures/schema_v1)
upgraded in place ends in exactly the catalog a fresh install has (schema.sql), by `drain
migrate`, by its printed SQL run through psql, and for a second table in a schema of its own;
rows that break the new constraints become dead letters and every constraint ends validated;
`drain check`/`status`/`dead` say when the table is older than the code; a newer one is left
alone; a drain on an older table stands by, saying to run `drain migrate`, and leads once it has
run. (Under load, with a drain and producers running: tests/faults/test_schema_upgrade.py.)
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import drain
from drain import cli, config, errors, testing
from drain import names as db_names
from drain.relay import loop as relay
from drain.store import migrations, sql
from tests.conftest import ManualClock, need_binary
from tests.support import schema_v1

LATEST = migrations.LATEST_VERSION
OTHER = ("Jobs Here", "my_jobs")  # quoted names, a table of its own in another schema

CATALOG = {
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = %(schema)s AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid), k.convalidated
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s ORDER BY 1, 2""",
    "indexes": """
        SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s ORDER BY 1""",
    "tables": """
        SELECT c.relname, c.reloptions, c.relreplident
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'S') ORDER BY 1""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s ORDER BY 1""",
}


def catalog(dsn: str, schema: str = "public") -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as conn:
        return {key: conn.execute(query, {"schema": schema}).fetchall() for key, query in CATALOG.items()}  # type: ignore[call-overload]


def version_rows(dsn: str, schema: str = "public", table: str = "staged_jobs") -> list[int]:
    names = sql.Names(schema, table)
    with psycopg.connect(dsn) as conn:
        query = psycopg.sql.SQL("SELECT version FROM {}.{} ORDER BY 1").format(
            psycopg.sql.Identifier(schema), psycopg.sql.Identifier(names.versions)
        )
        return [row[0] for row in conn.execute(query)]


def migrate(
    dsn: str, schema: str = "public", table: str = "staged_jobs", **options: Any
) -> migrations.Report:
    """drain.store.migrations.upgrade, as Store.migrate runs it (``options``: upgrade's keywords)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return migrations.upgrade(migrations.Autocommit(conn), sql.Names(schema, table), **options)


@pytest.fixture
def v1_database() -> Iterator[str]:
    """A database whose staged_jobs (and "Jobs Here".my_jobs) drain 0.1.0 created."""
    with schema_v1.empty_database() as dsn:
        schema_v1.install(dsn)
        schema_v1.install(dsn, *OTHER)
        yield dsn


def test_the_upgrade_from_version_1_rebuilds_schema_sql(v1_database: str, database: str) -> None:
    """The equivalent of procrastinate's "the migrations rebuild schema.sql" test."""
    migrate(database, *OTHER)  # the template made public.staged_jobs fresh already
    with psycopg.connect(v1_database) as conn:
        conn.execute("INSERT INTO staged_jobs (job_name) VALUES ('app.t')")  # populated
    for schema, table in (("public", "staged_jobs"), OTHER):
        report = migrate(v1_database, schema, table, repair=False)  # the steps alone
        assert (report.before, report.after, report.buried, report.not_valid) == (1, LATEST, 0, [])
        assert version_rows(v1_database, schema, table) == list(range(2, LATEST + 1))
        assert version_rows(database, schema, table) == [LATEST]
        assert catalog(v1_database, schema) == catalog(database, schema)
    again = migrate(v1_database)
    assert (again.before, again.after) == (LATEST, LATEST)  # idempotent
    assert catalog(v1_database) == catalog(database)


def test_drain_migrate_recreates_what_is_missing_from_a_current_table(database: str) -> None:
    with psycopg.connect(database) as conn:
        conn.execute("DROP TABLE staged_jobs_schedules")
        conn.execute("DROP INDEX staged_jobs_dead_dead_id_idx")
        conn.execute("DROP TRIGGER drain_wake ON staged_jobs")
    with schema_v1.empty_database() as fresh:
        migrate(fresh)
        assert catalog(database) != catalog(fresh)
        assert migrate(database).before == LATEST
        assert catalog(database) == catalog(fresh)


def test_the_printed_sql_upgrades_through_psql_and_guards_its_start(v1_database: str) -> None:
    psql = need_binary("psql", "postgresql-client")
    names = sql.Names("public", "staged_jobs")

    def run(script: str, dsn: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn],
            input=script,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    refused = run(migrations.script(names), v1_database)  # the fresh install over an old table
    assert refused.returncode != 0 and "already exists at an older schema version" in refused.stderr
    upgraded = run(migrations.script(names, 1), v1_database)
    assert upgraded.returncode == 0, upgraded.stderr
    assert run(migrations.script(names, 1), v1_database).returncode == 0  # idempotent
    with schema_v1.empty_database() as fresh, schema_v1.empty_database() as printed:
        migrate(fresh)
        created = run(migrations.script(names), printed)
        assert created.returncode == 0, created.stderr
        assert catalog(printed) == catalog(fresh) == catalog(v1_database)


BREAKING = {  # by the column each breaks
    "run_at": "INSERT INTO staged_jobs (job_name, run_at) VALUES ('app.far', 'infinity')",
    "created_at": "INSERT INTO staged_jobs (job_name, created_at) VALUES ('app.old', '1969-12-31 23:59Z')",
    "queue": "INSERT INTO staged_jobs (job_name, queue) VALUES ('app.q', E' \\t')",
    "backend": "INSERT INTO staged_jobs (job_name, backend) VALUES ('app.b', repeat('b', 1025))",
    "job_name": "INSERT INTO staged_jobs (job_name) VALUES (repeat('é', 513))",
    "attempts": "INSERT INTO staged_jobs (job_name, attempts) VALUES ('app.a', -1)",
}


def test_rows_breaking_a_new_constraint_become_dead_letters_and_every_constraint_is_valid(
    v1_database: str,
) -> None:
    with psycopg.connect(v1_database) as conn:
        for statement in BREAKING.values():
            conn.execute(statement)  # type: ignore[call-overload]
        conn.execute(
            "INSERT INTO staged_jobs (job_name, run_at) SELECT 'app.good', now() FROM generate_series(1, 3)"
        )
        conn.execute(  # a dead letter of 0.1.0, numbered by the row's id
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "options, created_at, attempts, error) "
            "VALUES (40, 'app.dead', '[]', '{}', 'q', 'default', gen_random_uuid(), '{}', now(), 3, 'e')"
        )
    report = migrate(v1_database)
    assert (report.buried, report.not_valid) == (len(BREAKING), [])
    with psycopg.connect(v1_database) as conn:
        assert conn.execute("SELECT job_name FROM staged_jobs").fetchall() == [("app.good",)] * 3
        dead = dict(
            conn.execute(
                "SELECT error, dead_id FROM staged_jobs_dead WHERE job_name <> 'app.dead'"
            ).fetchall()
        )
        assert sorted(error.split()[2] for error in dead) == sorted(BREAKING)
        assert all(error.startswith("drain migrate: ") and " must " in error for error in dead)
        assert conn.execute(
            "SELECT dead_id, id FROM staged_jobs_dead WHERE job_name = 'app.dead'"
        ).fetchone() == (40, 40)
        assert min(dead.values()) > 40  # numbered after the dead letters that were there
        assert conn.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'staged_jobs'::regclass AND NOT convalidated"
        ).fetchone() == (0,)
        for statement in BREAKING.values():  # and from now on refused at INSERT
            with pytest.raises(psycopg.errors.InvalidParameterValue), conn.transaction():
                conn.execute(statement)  # type: ignore[call-overload]


def test_a_schema_newer_than_the_code_is_left_alone(
    database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(database) as conn:
        conn.execute(
            "INSERT INTO staged_jobs_versions (version, description, drain_version) VALUES (9, 'x', '9.0')"
        )
    with pytest.raises(
        errors.SchemaError, match=f"at schema version 9, newer than this drain's {LATEST}: nothing done"
    ):
        migrate(database)
    assert cli.main(["migrate", "--dsn", database], env={}) == cli.EXIT_FAILURE
    assert capsys.readouterr().err.count("\n") == 1


def test_check_status_and_dead_say_to_run_drain_migrate_on_an_older_schema(
    v1_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = f'"public"."staged_jobs" is at schema version 1, this drain expects {LATEST}: run `drain migrate`'
    config_argv = ["--dsn", v1_database]
    assert (
        cli.main(["check", *config_argv], env={"DRAIN_BACKENDS__DEFAULT__TYPE": "memory"})
        == cli.EXIT_CHECK_FAILED
    )
    assert f"drain: {line}\n" in capsys.readouterr().err
    assert cli.main(["status", *config_argv], env={}) == cli.EXIT_OK
    assert capsys.readouterr().err == f"drain: {line}\n"
    assert cli.main(["dead", "list", *config_argv], env={}) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs schema version" in err and "run `drain migrate`" in err
    assert cli.main(["migrate", *config_argv], env={}) == cli.EXIT_OK
    assert f"schema version {LATEST}, upgraded from 1" in capsys.readouterr().out
    assert cli.main(["check", *config_argv], env={"DRAIN_BACKENDS__DEFAULT__TYPE": "memory"}) == cli.EXIT_OK
    assert cli.main(["status", "--json", *config_argv], env={}) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert f'"schema_version": {LATEST}' in out and err == ""


def test_the_longest_table_name_gets_every_derived_object_under_its_full_name(database: str) -> None:
    """The longest name the config accepts: nothing truncated, nothing missing (with 58
    characters, which drain 0.1.0 accepted, the dead letters' job_id index never existed)."""
    table = "t" * (db_names.MAX_IDENTIFIER_BYTES - len("_dead_dead_id_idx"))
    names = sql.Names("public", table)
    migrate(database, "public", table)
    with psycopg.connect(database) as conn:
        found = {row[0] for row in conn.execute("SELECT relname FROM pg_class WHERE relname LIKE 't%'")}
        found |= {row[0] for row in conn.execute("SELECT proname FROM pg_proc WHERE proname LIKE 't%'")}
    assert set(names.derived().values()) <= found


OLDER = f'"public"."staged_jobs" is at schema version 1, this drain expects {LATEST}: run `drain migrate`'


def test_a_drain_on_an_older_schema_stands_by_until_migrated_and_never_buries_there(
    v1_database: str, clock: ManualClock, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """On 0.1.0's schema the dead letters are keyed by the staged row's id: a burial of a row
    whose id is already dead fails and takes its batch with it, every step (before: the new drain
    led there, published the good rows and could not settle them)."""
    with psycopg.connect(v1_database) as conn:
        poison = drain.stage(conn, "app.poison")
        drain.stage_many(conn, [drain.Job("app.good", args=[n]) for n in range(3)])
        conn.execute("UPDATE staged_jobs SET attempts = 2 WHERE job_id = %s", [poison])
        conn.execute(  # a dead letter of the same row id (the identity restarted since)
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "options, created_at, attempts, error) SELECT id, 'app.old', '[]', '{}', 'q', 'default', "
            "gen_random_uuid(), '{}', now(), 3, 'e' FROM staged_jobs WHERE job_id = %s",
            [poison],
        )
    memory = testing.MemoryAdapter("default")
    memory.behaviour = lambda job: "reject" if job.job_name == "app.poison" else "ack"
    settings = config.Settings(
        dsn=v1_database,
        settle_timeout_s=1.0,
        backends={"default": config.BackendSettings("default", "memory", 3, {})},
    )
    standby = relay.Relay(settings, {"default": memory}, clock=clock, jitter=lambda: 0.0)
    try:
        for _ in range(3):
            standby.turn()
            clock.advance(5.0)  # past settle_timeout_s: waiting for a migration has no time bound
        assert not standby.leadership.is_leader and memory.published == []
        assert standby.leadership.blocker is not None
        assert (standby.leadership.blocker.reason, standby.leadership.blocker.detail) == ("schema", OLDER)
        labels = {"reason": "schema"}
        assert standby.metrics.registry.get_sample_value("drain_cannot_settle", labels) == 1
        said = [r.getMessage() for r in caplog.records if "standing by" in r.getMessage()]
        assert said == [f"standing by: {OLDER}"]  # once
        env = {"DRAIN_BACKENDS__DEFAULT__TYPE": "memory"}
        capsys.readouterr()
        assert cli.main(["run", "--once", "--dsn", v1_database], env=env) == cli.EXIT_CANNOT_SETTLE
        err = capsys.readouterr().err
        assert err.startswith(f"drain: cannot lead here: {OLDER}") and err.count("\n") == 1, err
        assert cli.main(["status", "--dsn", v1_database], env={}) == cli.EXIT_OK
        assert f"can lead no (schema): {OLDER}" in capsys.readouterr().out
        with psycopg.connect(v1_database) as conn:
            assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (4,)
        migrate(v1_database)
        standby.turn()  # leads, and forwards the good rows and buries the poison in one step
        assert standby.leadership.is_leader
        assert sorted(job.job_name for job in memory.published) == ["app.good"] * 3
        assert standby.metrics.registry.get_sample_value("drain_cannot_settle", labels) == 0
        with psycopg.connect(v1_database) as conn:
            assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM staged_jobs_dead").fetchone() == (2,)
    finally:
        standby.shutdown()


@pytest.mark.parametrize(
    "ids",
    [
        [9_223_372_036_854_775_807],
        [-5, -7],
        [0],
        [12, 9_223_372_036_854_775_807],
        [9_223_372_036_854_775_806, 9_223_372_036_854_775_807],
        [9_223_372_036_854_775_797],
    ],
    ids=str,
)
def test_dead_letters_of_any_id_upgrade_and_new_ones_number_on(v1_database: str, ids: list[int]) -> None:
    """0.1.0 buried a row under its own id, and a producer may set any (OVERRIDING SYSTEM VALUE):
    the dead letters' own numbering started past the largest, which overflowed at the bigint
    maximum and fell under the identity's minimum when every id was 0 or less (red team 25)."""
    with psycopg.connect(v1_database) as conn:
        for dead_id in ids:
            conn.execute(
                "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
                "options, created_at, attempts, error) "
                "VALUES (%s, 'app.dead', '[]', '{}', 'q', 'default', gen_random_uuid(), '{}', now(), 3, 'e')",
                (dead_id,),
            )
    report = migrate(v1_database)
    assert (report.before, report.after) == (1, LATEST)
    with psycopg.connect(v1_database) as conn:
        conn.execute(  # a new dead letter gets a number of its own
            "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id, "
            "options, created_at, attempts, error) "
            "VALUES (1000, 'app.new', '[]', '{}', 'q', 'default', gen_random_uuid(), '{}', now(), 3, 'e')"
        )
        numbers = conn.execute("SELECT dead_id FROM staged_jobs_dead ORDER BY job_name, id").fetchall()
    old, new = [row[0] for row in numbers[:-1]], numbers[-1][0]
    assert sorted(old) == sorted(ids)  # listed as before
    assert 1 <= new < 2**62 and new not in old  # and room for every number to come

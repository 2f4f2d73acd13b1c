"""``drain check``: validate the configuration and reach every service; report every problem.

A backend is opened and pinged (it takes a publish), then asked what the drain needs there and
does not find (``drain.backend.CheckedAdapter``: RabbitMQ's queues, the Redis keys RQ and
Celery write, and the permission to write them)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import psycopg

from drain import backend, config, errors
from drain.cli import database, exit_codes, output
from drain.relay import lanes, leadership, wakeup
from drain.store import admin, migrations, writes
from drain.store import session as store


def cmd_check(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    if getattr(args, "show_config", False):
        show_config(settings)
    problems: list[str] = []
    adapters: dict[str, backend.Adapter] = {}
    if not settings.backends:
        problems.append("no backends configured: add a [backends.default] section")
    try:
        adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    except errors.ConfigError as exc:
        problems.extend(exc.problems)
    try:
        with database.connected(store.Store(settings)) as db:
            _database_problems(db, problems)
    except errors.DrainError as exc:
        problems.append(str(exc))
    for name, adapter in adapters.items():
        try:
            adapter.open()
            adapter.ping()
            if isinstance(adapter, backend.CheckedAdapter):
                problems.extend(f"backend {name}: {problem}" for problem in adapter.problems())
        except errors.BackendUnavailable as exc:
            problems.append(f"backend {name}: {exc}")
        finally:
            adapter.close()
    if problems:
        for problem in problems:
            output.say(problem)
        return exit_codes.EXIT_CHECK_FAILED
    print(f"drain: ok: database and {len(adapters)} backend(s) reachable")
    return exit_codes.EXIT_OK


def show_config(settings: config.Settings) -> None:
    """``drain check --show-config``: one line per effective key, ``key = value  # source``."""
    for key, value, source in config.describe(settings):
        print(f"{key} = {value}  # {source}")


def _database_problems(db: store.Store, problems: list[str]) -> None:
    """Add to ``problems`` what keeps the table, its schedules or its settlement from working (the
    ones found before an error that stops the check are kept); say the warnings at once."""
    db.require_table()
    problems.extend(_schema_problems(db))
    if db.settings.schedules and not db.schedules_table_exists():
        problems.append(f"schedules: table {db.names.schedules} does not exist; run `drain migrate`")
    if (warning := wakeup.trigger_warning(db)) is not None:
        output.say(f"warning: {warning}")
    if db.settings.lanes > 1 and (problem := db.lanes_index_problem(db.settings.lanes)) is not None:
        output.say(f"warning: {lanes.index_warning(db, db.settings.lanes, problem)}")
    blocked, row_security = can_settle(db)
    problems.extend(  # an older schema is said above
        f"database: drain run cannot lead here: {b.detail}" for b in blocked if b.reason != leadership.SCHEMA
    )
    if row_security is not None:
        problems.append(f"database: {row_security}")


def can_settle(db: store.Store) -> tuple[list[leadership.Blocker], str | None]:
    """What would keep ``drain run`` with this session's DSN and role from leading here: the
    relay's own check, and its probe (the table tested with a row of its own, or the due rows
    its first batch would take, rolled back); and what the check says about row-level security
    (leadership.row_security), or None."""
    check = db.settle_check()
    found = leadership.blockers(check)
    if not found:
        try:
            failure = db.probe_settlement(db.settings.batch_size)
        except psycopg.Error as exc:
            found.append(leadership.probe_fails(writes.SELECT, errors.first_line(exc)))
        else:
            if failure is not None:
                found.append(leadership.probe_fails(*failure))
    return found, leadership.row_security(check)


def _schema_problems(db: store.Store) -> list[str]:
    """What `drain check` says about the table's schema version and constraints."""
    try:
        version = db.schema_version()
        not_valid = admin.Admin(db.conn, db.names).not_valid_constraints()
    except psycopg.errors.InsufficientPrivilege as exc:
        return [
            f"cannot read the schema version ({errors.first_line(exc)}): grant SELECT on "
            f"{db.names.versions} (deploy/database/drain-role.sql)"
        ]
    except psycopg.Error as exc:
        return [f"cannot read the schema version: {errors.first_line(exc)}"]
    found = []
    if version < migrations.LATEST_VERSION:
        found.append(older_schema(db.names.qualified, version))
    elif version > migrations.LATEST_VERSION:
        output.say(
            f"warning: {db.names.qualified} is at schema version {version}, newer than this "
            f"drain's {migrations.LATEST_VERSION}"
        )
    found.extend(
        f"constraint {name} of {db.names.qualified} is NOT VALID (rows break it): run `drain migrate`"
        for name in not_valid
    )
    return found


def older_schema(qualified: str, version: int) -> str:
    """The problem of a table at an older schema version than this drain's."""
    return leadership.older_schema(qualified, version, migrations.LATEST_VERSION)

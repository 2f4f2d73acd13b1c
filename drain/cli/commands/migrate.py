"""``drain migrate``: create the table or upgrade it in place; ``--print`` shows the SQL instead."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from drain import config, errors
from drain.cli import database, exit_codes, output
from drain.store import migrations, sql
from drain.store import session as store


def cmd_migrate(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    names = sql.Names(settings.schema, settings.table)
    if args.print:
        slots = migrations.wake_slots(settings.lanes)
        print(migrations.script(names, args.from_version, wake_slots=slots, lanes=settings.lanes), end="")
        return exit_codes.EXIT_OK
    if args.from_version is not None:
        raise errors.ConfigError("--from: only with --print (drain migrate reads the version itself)")
    # A psycopg error (e.g. the drain's own role, which may create nothing) is one line.
    with database.connected(store.Store(settings)) as db:
        report = db.migrate()
    if report.buried:
        output.say(
            f"{report.buried} row(s) the table's new check refuses are now dead letters: "
            "`drain dead list` shows them, each with its problem"
        )
    for name in report.not_valid:
        output.say(f"warning: constraint {name} is NOT VALID: rows still break it; run `drain migrate` again")
    change = "created" if report.before == 0 else f"upgraded from {report.before}"
    if report.before == report.after:
        change = "already current"
    print(
        f"drain: {names.qualified} and {settings.dead_table} are ready "
        f"(schema version {report.after}, {change})"
    )
    return exit_codes.EXIT_OK

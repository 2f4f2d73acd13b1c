"""``drain dead list|retry|purge``: the dead-letter table, filtered by backend/queue/job/id."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from drain import config
from drain.cli import database, exit_codes, output
from drain.store import admin, migrations
from drain.store import session as store


def cmd_dead(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    """``drain dead list|retry|purge``: the dead-letter table, filtered by backend/queue/job/id."""
    filters = dead_filter(args)
    if args.dead_command == "purge" and filters.everything and not args.yes:
        output.say("refusing to purge every dead letter without --yes (or filter with --id/--backend/...)")
        return exit_codes.EXIT_NOT_CONFIRMED
    refused = taken = 0
    with database.connected(store.Store(settings)) as db:
        db.require_table()
        db.require_version(
            migrations.KEYS_VERSION, "`drain dead` (dead letters numbered on their own, with their key)"
        )
        queries = admin.Admin(db.conn, db.names)
        if args.dead_command == "list":
            found = queries.dead_list(filters)
        elif args.dead_command == "retry":
            count, refused, taken = queries.dead_retry(filters)[:3]
        else:
            count, _, taken = queries.dead_purge(filters)[:3]
    held = f"; {taken} skipped: another command held them at the same time" if taken else ""
    if args.dead_command == "retry":
        print(f"drain: {count} dead letter(s) staged again in {db.names.qualified}{held}")
        if refused:
            output.say(
                f"{refused} dead letter(s) left: the table refuses them (they break its "
                "constraints; `drain dead list` says which); fix or purge them"
            )
    elif args.dead_command == "purge":
        print(f"drain: {count} dead letter(s) purged from {settings.dead_table}{held}")
    elif args.json:
        print(json.dumps([_dead_json(row) for row in found]))
    else:
        for row in found:
            error = output.shown(" ".join(str(row["error"]).split()))
            name, backend, queue = (
                output.shown(str(row[field])) for field in ("job_name", "backend", "queue")
            )
            print(
                f"{row['dead_id']}\t{row['job_id']}\t{name}\t{backend}/{queue}\t"
                f"key={output.key(row['ordering_key'])}\tattempts={row['attempts']}\t"
                f"{output.when(row['dead_at'])}\t{error}"
            )
    return exit_codes.EXIT_OK


def dead_filter(args: argparse.Namespace) -> admin.DeadFilter:
    """The dead letters the command line selects (``--id``, ``--backend``, ``--queue``, ...)."""
    return admin.DeadFilter(
        backend=args.dead_backend,
        queue=args.dead_queue,
        job_name=args.dead_job_name,
        ids=args.ids,
        limit=args.limit,
    )


def _dead_json(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["dead_id"],
        "row_id": row["row_id"],
        "job_id": str(row["job_id"]),
        "job_name": row["job_name"],
        "args": row["job_args"],
        "kwargs": row["job_kwargs"],
        "queue": row["queue"],
        "backend": row["backend"],
        "ordering_key": row["ordering_key"],
        "options": row["options"],
        "attempts": row["attempts"],
        "error": row["error"],
        "created_at": output.when(row["created_at"]),
        "dead_at": output.when(row["dead_at"]),
    }

"""``drain schedules``: each schedule (configured, or removed with its history) and its ticks."""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Mapping
from typing import Any

from drain import config, errors
from drain.cli import database, exit_codes
from drain.relay import schedules
from drain.store import session as store


def cmd_schedules(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    """``drain schedules``: each schedule (configured, or removed with its history) and its ticks."""
    with database.connected(store.Store(settings)) as db:
        db.require_table()
        if not db.schedules_table_exists():
            raise errors.SchemaError(f"table {db.names.schedules} does not exist; run `drain migrate`")
        found = schedules.listing(db, settings.schedules)
    if args.json:
        print(json.dumps([_entry_json(entry) for entry in found]))
        return exit_codes.EXIT_OK
    if not found:
        print("drain: no schedules configured or recorded")
    for entry in found:
        state = "" if entry["configured"] else "\t(removed from the config)"
        print(
            f"{entry['name']}\t{entry['cron']}\t{entry['timezone']}\t"
            f"last {_when(entry['last_tick']) or '-'}\tnext {_when(entry['next_tick']) or '-'}{state}"
        )
    return exit_codes.EXIT_OK


def _entry_json(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **entry,
        "last_tick": _when(entry["last_tick"]),
        "next_tick": _when(entry["next_tick"]),
        "last_job_id": None if entry["last_job_id"] is None else str(entry["last_job_id"]),
    }


def _when(value: datetime.datetime | None) -> str | None:
    return None if value is None else value.isoformat()

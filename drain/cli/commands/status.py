"""``drain status``: the table's backlog, lag, dead letters, leader, standbys, and whether the
drain can lead here; as text, or ``--json`` (one object)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from drain import config
from drain.cli import database, exit_codes, output
from drain.cli.commands import check
from drain.relay import leadership
from drain.store import admin, identity, migrations, writes
from drain.store import session as store


def cmd_status(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    with database.connected(store.Store(settings)) as db:
        report = _report(db)
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
    return exit_codes.EXIT_OK


def _report(db: store.Store) -> dict[str, Any]:
    """The figures ``drain status`` prints, read on ``db``; the keys of its JSON object."""
    settings = db.settings
    db.require_table()
    queries = admin.Admin(db.conn, db.names)
    parked = queries.parked()
    holder = queries.leader(leadership.lock_key(settings.schema, settings.table))
    me = identity.parse(identity.application_name())
    drains = [
        d for d in map(identity.parse, queries.drains()) if d is not None and d != me
    ]  # not this command
    blocked, row_security = check.can_settle(db)
    try:
        version: int | None = db.schema_version()
    except psycopg.errors.InsufficientPrivilege:
        version = None  # the drain's role from before versions: status works without it
    figures = _figures(db, version)
    return {
        "table": db.names.qualified,
        "schema_version": version,
        "backlog": figures["backlog"],
        "due": figures["due"],
        "future": figures["future"],
        "oldest_due_age_s": round(float(figures["oldest_due_age_s"]), 3),
        "dead": figures["dead"],
        "parked": parked,
        **_blocked(figures),
        "leader": None if holder is None else _leader(holder),
        "standbys": _standbys(holder, drains),
        "can_lead": not blocked,
        "cannot_lead": [{"reason": b.reason, "detail": b.detail} for b in blocked],
        "warnings": [] if row_security is None else [row_security],
    }


def _figures(db: store.Store, version: int | None) -> dict[str, Any]:
    """Store.status, exact; the blocked rows only on a table that has ordering keys."""
    if version is not None and version < migrations.KEYS_VERSION:
        return db.status(keys=False)
    try:
        return db.status()
    except psycopg.errors.UndefinedColumn:  # an older table, its version unreadable to this role
        return db.status(keys=False)


def _blocked(figures: Mapping[str, Any]) -> dict[str, Any]:
    """The due rows their ordering key holds back: blocked (rows), blocked_keys, and the oldest
    (None without one); None for all on a table older than the ordering key."""
    if "blocked" not in figures:
        return {"blocked": None, "blocked_keys": None, "oldest_blocked": None}
    oldest = None
    if figures["oldest_blocked_id"] is not None:
        oldest = {
            "id": figures["oldest_blocked_id"],
            "ordering_key": figures["oldest_blocked_key"],
            "age_s": round(float(figures["oldest_blocked_age_s"]), 3),
            "behind": figures["oldest_blocked_behind"],
        }
    return {"blocked": figures["blocked"], "blocked_keys": figures["blocked_keys"], "oldest_blocked": oldest}


def _print_text(report: Mapping[str, Any]) -> None:
    leader = report["leader"]
    who = "none" if leader is None else _who(leader)
    others = ", ".join(f"{d['process']} (drain {d['version']})" for d in report["standbys"]) or "none"
    version = report["schema_version"]
    if version is not None and version < migrations.LATEST_VERSION:
        output.say(check.older_schema(report["table"], version))
    print(
        f"table {report['table']}\n"
        f"  backlog  {report['backlog']} ({report['due']} due, {report['future']} scheduled)\n"
        f"  lag      {report['oldest_due_age_s']}s (oldest due job)\n"
        f"  dead     {report['dead']}\n"
        f"  leader   {who}\n"
        f"  standbys {others}"
    )
    if report["parked"]:
        print(
            f"  parked   {report['parked']} (the table refused their settlement: run_at "
            f"{writes.PARKED_AT.isoformat()} and last_error starting {writes.PARKED_PREFIX!r}, or, parked "
            f"in place, last_error starting {writes.PARKED_IN_PLACE_PREFIX!r}; see docs/drain-process.md, "
            "Settlement failures)"
        )
    oldest = report["oldest_blocked"]
    if oldest is not None:
        behind = (
            "a dead letter of its key (block_on_dead_letter)"
            if oldest["behind"] is None
            else f"row {oldest['behind']}"
        )
        print(
            f"  blocked  {report['blocked_keys']} key(s), {report['blocked']} due row(s) waiting for a "
            f"lower id of their ordering key; oldest row {oldest['id']} (key "
            f"{output.key(oldest['ordering_key'])}, {oldest['age_s']}s), behind {behind}"
        )
    for blocker in report["cannot_lead"]:
        print(f"  can lead no ({blocker['reason']}): {blocker['detail']}")
    if not report["cannot_lead"]:
        print("  can lead yes (a read-write primary where this role can delete)")
    for warning in report["warnings"]:
        print(f"  warning  {warning}")


def _leader(holder: Mapping[str, Any]) -> dict[str, Any]:
    """The lock holder as status reports it: its drain process (drain.store.identity) and session."""
    found = identity.parse(holder["application_name"])
    started = holder["backend_start"]
    since = found.since if found is not None and found.since is not None else started
    return {
        "host": found.host if found is not None else None,
        "process_id": found.pid if found is not None else None,
        "version": found.version if found is not None else None,
        "since": since.isoformat() if since is not None else None,
        "backend_pid": holder["pid"],
        "application_name": holder["application_name"],
        "client_addr": holder["client_addr"],
    }


def _standbys(holder: Mapping[str, Any] | None, drains: Sequence[identity.Drain]) -> list[dict[str, Any]]:
    """The other drain processes connected to this database (one per process, leader excluded)."""
    leading = identity.parse(holder["application_name"]) if holder is not None else None
    seen: dict[str, dict[str, Any]] = {}
    for found in drains:
        if leading is not None and found.process == leading.process:
            continue
        seen.setdefault(
            found.process,
            {"host": found.host, "process_id": found.pid, "version": found.version, "process": found.process},
        )
    return [seen[key] for key in sorted(seen)]


def _who(leader: Mapping[str, Any]) -> str:
    if leader["process_id"] is None:
        return f"backend pid {leader['backend_pid']} ({leader['application_name']}), since {leader['since']}"
    return (
        f"{leader['process_id']}@{leader['host']} (drain {leader['version']}), since {leader['since']}, "
        f"backend pid {leader['backend_pid']}"
    )

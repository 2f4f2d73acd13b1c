"""``drain status``: the table's backlog, lag, dead letters, leader, standbys, and whether the
drain can lead here; with lanes, who leads which lane and each lane's backlog and lag; as text,
or ``--json`` (one object)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from drain import config
from drain.cli import database, exit_codes, output
from drain.cli.commands import check
from drain.relay import lanes, leadership
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
    members = lanes.members(db)
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
        "lanes": None if version is not None and version < migrations.KEYS_VERSION else _lanes(db, members),
        "standbys": _standbys(holder, drains, members),
        "can_lead": not blocked,
        "cannot_lead": [{"reason": b.reason, "detail": b.detail} for b in blocked],
        "warnings": [] if row_security is None else [row_security],
    }


LANE_CAP = 1_000_000
"""The per-lane counts walk at most this many due rows of each branch (lanes.backlog): a backlog
of tens of millions costs what the gauges' refresh costs ten times over, not a full scan."""


def _lanes(db: store.Store, members: Sequence[lanes.Member]) -> dict[str, Any] | None:
    """With lanes (the setting, or members found running with them): the count, each member and
    the lanes it leads, and each lane's leader, due rows and lag; None without lanes."""
    count = lanes.lane_count(db.settings.lanes, members)
    if count <= 1:
        return None
    found = lanes.backlog(db, count, LANE_CAP)
    leaders = {lane: member for member in members for lane in member.led}
    shown = [_member(member) for member in members if member.lanes is not None or member.led]
    return {
        "count": count,
        "counts_running": sorted({member.lanes for member in members if member.lanes is not None}),
        "members": shown,
        "capped": found.capped,
        "by_lane": [
            {
                "lane": each.lane,
                "leader": None if each.lane not in leaders else shown_process(leaders[each.lane]),
                "backend_pid": None if each.lane not in leaders else leaders[each.lane].backend_pid,
                "due": each.due,
                "oldest_due_age_s": each.oldest_due_age_s,
            }
            for each in found.lanes
        ],
    }


def _member(member: lanes.Member) -> dict[str, Any]:
    """A member as status reports it: as a leader (_leader), with its count and the lanes it leads."""
    holder = {
        "pid": member.backend_pid,
        "application_name": member.application_name,
        "client_addr": member.client_addr,
        "backend_start": member.backend_start,
    }
    return {**_leader(holder), "lanes": member.lanes, "led": list(member.led)}


def shown_process(member: lanes.Member) -> str:
    """A member's drain process (``pid@host``), or its backend where its session is not a drain's."""
    found = identity.parse(member.application_name)
    return found.process if found is not None else f"backend pid {member.backend_pid}"


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
    laned = report["lanes"]
    if laned is not None and leader is None:
        who = f"none: {len(laned['members'])} member(s) lead the lanes"
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
    if laned is not None:
        _print_lanes(laned)
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


def _print_lanes(laned: Mapping[str, Any]) -> None:
    """Members and the lanes each leads; each lane with due rows or no leader (the others: led,
    nothing due, in one line)."""
    members = laned["members"]
    shares = "/".join(str(len(member["led"])) for member in members) or "none"
    print(f"  lanes    {laned['count']}, members {len(members)}, lanes led {shares}")
    others = [count for count in laned["counts_running"] if count != laned["count"]]
    if others:
        print(
            f"  warning  members run with lanes = {', '.join(map(str, laned['counts_running']))}: a "
            "change of the count is under way (the drains of the new count stand by until the last "
            "drain of the old one stops)"
        )
    for member in members:
        led = ",".join(map(str, member["led"])) or "none"
        print(f"  member   {_who(member)}; lanes {member['lanes']}, leads {led}")
    quiet = 0
    for lane in laned["by_lane"]:
        if lane["leader"] is not None and not lane["due"]:
            quiet += 1
            continue
        leader = lane["leader"] or "NONE"
        print(f"  lane {lane['lane']:<3} leader {leader}, {lane['due']} due, lag {lane['oldest_due_age_s']}s")
    if quiet:
        print(f"  lanes    {quiet} more led, nothing due")
    if laned["capped"]:
        print(f"  lanes    counted over the first {LANE_CAP} due rows of each branch")


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


def _standbys(
    holder: Mapping[str, Any] | None, drains: Sequence[identity.Drain], members: Sequence[lanes.Member]
) -> list[dict[str, Any]]:
    """The other drain processes connected to this database (one per process, the leader and the
    members of the lanes excluded)."""
    leading = {
        found.process
        for found in map(identity.parse, [holder["application_name"] if holder is not None else None])
        if found is not None
    }
    leading |= {found.process for found in (identity.parse(m.application_name) for m in members) if found}
    seen: dict[str, dict[str, Any]] = {}
    for found in drains:
        if found.process in leading:
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

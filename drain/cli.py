"""The ``drain`` command. The only module that installs signal handlers or reads os.environ.

Exit codes::

    0  success (and after a graceful SIGTERM)
    1  a runtime failure: the database or a backend could not be reached, work was left; or the
       watchdog found the loop stuck for ``watchdog_s`` (every thread's stack is on stderr)
    2  a usage or configuration mistake (bad flag, bad config file, bad job argument)
    3  ``drain check`` found problems
    4  ``drain run`` refused to lead (a transaction-pooling proxy is in the way)
    5  ``drain dead purge`` without a filter, ``--id`` or ``--yes`` (nothing deleted)
    6  ``drain run`` could not settle (delete what it publishes) for ``settle_timeout_s``: a
       settlement kept failing, or it could not lead where it is connected (read-only, missing
       privileges, a DELETE that fails); ``--once``: at once, also on a table older than the
       drain (``run`` waits for `drain migrate` there without a bound)
    143 a second SIGTERM/SIGINT forced an immediate exit (the batch rolled back; nothing lost)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from drain import __version__, backend, config, errors
from drain.backend import defined
from drain.observability import logs, metrics
from drain.relay import failpoints, leadership, schedules, settling, wakeup, watchdog
from drain.relay import loop as relay
from drain.staging import sync as staging
from drain.store import identity, migrations
from drain.store import session as store

log = logging.getLogger("drain")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CHECK_FAILED = 3
EXIT_REFUSED = 4
EXIT_NOT_CONFIRMED = 5
EXIT_CANNOT_SETTLE = 6
EXIT_FORCED = 143
DEAD_ID_VERSION = 2  # the schema version in which dead letters got an id of their own
STOPPING = "stopping after the current batch (a second signal exits at once)"
STOPPING_LINE = f"drain: {STOPPING}\n".encode()  # with log_format text
FORCED = "second signal: exiting at once (the batch rolls back)"

# The format of the lines written outside logging: the config's once loaded, before that the
# flag's or DRAIN_LOG_FORMAT's (a config that fails to load cannot say), else text.
_stderr = {"format": logs.TEXT}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        _say(f"{message} (see `drain --help`)")
        raise SystemExit(EXIT_USAGE)


def _common() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--config", help="TOML config file (default: $DRAIN_CONFIG)")
    common.add_argument("--dsn", help="database URL (default: $DRAIN_DSN, the file, $DATABASE_URL, PG*)")
    common.add_argument("--schema", help="schema of the staged-jobs table (default: public)")
    common.add_argument("--table", help="staged-jobs table (default: staged_jobs)")
    common.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    common.add_argument("--log-format", choices=list(logs.FORMATS), help="stderr lines (default: text)")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(prog="drain", description="A transactionally-staged job drain for Postgres.")
    parser.add_argument("--version", action="version", version=f"drain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    migrate = commands.add_parser(
        "migrate", parents=[common], help="create the table or upgrade it in place (idempotent)"
    )
    migrate.add_argument("--print", action="store_true", help="print the SQL instead of running it")
    migrate.add_argument(
        "--from",
        dest="from_version",
        type=positive_int,
        metavar="VERSION",
        help="with --print: the upgrade of a table at this schema version (default: a fresh install)",
    )

    run = commands.add_parser("run", parents=[common], help="lead or stand by, and forward jobs")
    run.add_argument("--once", action="store_true", help="forward what is due now, then exit")
    run.add_argument("--batch-size", type=int, help="rows per batch (default: 500)")

    check = commands.add_parser("check", parents=[common], help="validate the config, reach every service")
    check.add_argument(
        "--show-config",
        action="store_true",
        help="first print every effective setting and where it came from (secrets masked)",
    )

    status = commands.add_parser("status", parents=[common], help="backlog, lag, dead letters, leader")
    status.add_argument("--json", action="store_true", help="print JSON")

    listed = commands.add_parser("schedules", parents=[common], help="each schedule's last and next tick")
    listed.add_argument("--json", action="store_true", help="print JSON, one array")

    stage = commands.add_parser("stage", parents=[common], help="stage one job from the shell")
    stage.add_argument("job_name")
    stage.add_argument("args_json", nargs="?", default="[]", help="positional args, a JSON array")
    stage.add_argument("--kwargs", default="{}", help="keyword args, a JSON object")
    stage.add_argument("--queue", default="default")
    stage.add_argument("--backend", default="default")
    stage.add_argument("--delay", type=float, help="seconds from now")
    stage.add_argument("--job-id", help="the job's UUID (default: generated)")
    stage.add_argument("--options", default="{}", help="backend options, a JSON object")

    allowed = commands.add_parser(
        "allowed-jobs",
        help="print RQ allowed_jobs: the functions these modules define (run it where the workers run)",
    )
    allowed.add_argument("modules", nargs="+", metavar="MODULE", help="a task module, e.g. app.tasks")
    allowed.add_argument("--path", default=".", help="put this directory first on sys.path (default: .)")

    dead = commands.add_parser("dead", help="list, retry or purge dead letters")
    dead_commands = dead.add_subparsers(
        dest="dead_command", required=True, metavar="ACTION", parser_class=_Parser
    )
    dead_filters = _dead_filters()
    dead_list = dead_commands.add_parser("list", parents=[common, dead_filters], help="show dead letters")
    dead_list.add_argument("--json", action="store_true", help="print JSON, one array")
    dead_commands.add_parser(
        "retry", parents=[common, dead_filters], help="stage them again (new row, same job_id, due now)"
    )
    purge = dead_commands.add_parser("purge", parents=[common, dead_filters], help="delete them")
    purge.add_argument("--yes", action="store_true", help="required to purge every dead letter")
    return parser


def _dead_filters() -> _Parser:
    filters = _Parser(add_help=False)
    filters.add_argument(
        "--id", dest="ids", type=positive_int, nargs="+", metavar="N", help="these dead-letter ids"
    )
    filters.add_argument("--backend", dest="dead_backend", help="only this backend")
    filters.add_argument("--queue", dest="dead_queue", help="only this queue")
    filters.add_argument("--job-name", dest="dead_job_name", help="only this job name")
    filters.add_argument("--limit", type=positive_int, help="at most this many (oldest first)")
    return filters


def load_settings(args: argparse.Namespace, env: Mapping[str, str]) -> config.Settings:
    overrides = {
        "dsn": args.dsn,
        "schema": args.schema,
        "table": args.table,
        "log_level": args.log_level,
        "log_format": getattr(args, "log_format", None),
        "batch_size": getattr(args, "batch_size", None),
    }
    return config.load(args.config, env=env, overrides=overrides)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run one command; return its exit code. User mistakes print one line, never a traceback."""
    env = os.environ if env is None else env
    _stderr["format"] = logs.format_from(env)
    args = build_parser().parse_args(argv)
    _stderr["format"] = getattr(args, "log_format", None) or _stderr["format"]
    if args.command == "allowed-jobs":  # the app's environment, not the drain's: no config
        return cmd_allowed_jobs(args)
    try:
        settings = load_settings(args, env)
        _stderr["format"] = settings.log_format
        logs.configure(settings.log_level, settings.log_format)
        handler = COMMANDS[args.command]
        return handler(args, settings, env)
    except errors.ConfigError as exc:
        _say(f"configuration: {exc}")
        return EXIT_USAGE
    except errors.StagingError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except errors.PoolerDetected as exc:
        _say(f"refusing to lead: {exc}")
        return EXIT_REFUSED
    except errors.CannotSettle as exc:
        _say(f"{exc}; exiting")
        return EXIT_CANNOT_SETTLE
    except errors.DrainError as exc:
        _say(str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FORCED


def _say(message: str) -> None:
    """One line on stderr: ``drain: message``, or with log_format json a JSON object (level ERROR)."""
    sys.stderr.write(logs.render(message, _stderr["format"]))


def cmd_allowed_jobs(args: argparse.Namespace) -> int:
    """Print ``allowed_jobs`` for the public functions the modules define (drain.backend.defined)."""
    try:
        modules = defined.import_modules(args.modules, args.path)
        sys.stdout.write(defined.toml_snippet(modules, f"drain allowed-jobs {' '.join(args.modules)}"))
    except errors.ConfigError as exc:
        _say(str(exc))
        return EXIT_USAGE
    return EXIT_OK


def _connect_store(settings: config.Settings) -> store.Store:
    db = store.Store(settings)
    _ = db.conn
    return db


def cmd_migrate(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    import psycopg

    from drain.store import sql

    names = sql.Names(settings.schema, settings.table)
    if args.print:
        print(migrations.script(names, args.from_version), end="")
        return EXIT_OK
    if args.from_version is not None:
        raise errors.ConfigError("--from: only with --print (drain migrate reads the version itself)")
    db = store.Store(settings)
    try:
        report = db.migrate()
    except psycopg.Error as exc:  # e.g. the drain's own role, which may create nothing: one line
        raise _database_error(exc) from None
    finally:
        db.close()
    if report.buried:
        _say(
            f"{report.buried} row(s) the table's new check refuses are now dead letters: "
            "`drain dead list` shows them, each with its problem"
        )
    for name in report.not_valid:
        _say(f"warning: constraint {name} is NOT VALID: rows still break it; run `drain migrate` again")
    change = "created" if report.before == 0 else f"upgraded from {report.before}"
    if report.before == report.after:
        change = "already current"
    print(
        f"drain: {names.qualified} and {settings.dead_table} are ready "
        f"(schema version {report.after}, {change})"
    )
    return EXIT_OK


def _database_error(exc: Exception) -> errors.DrainError:
    return errors.DrainError(f"database error: {errors.first_line(exc)}")


@contextlib.contextmanager
def _signals(stop: threading.Event) -> Iterator[None]:
    """First SIGTERM/SIGINT: finish the batch, release the lock, exit 0. Second: exit at once."""

    def handle(signum: int, frame: FrameType | None) -> None:
        # os.write, not logging or sys.stderr: a handler that interrupts a write to either would
        # re-enter it. logs.render takes no lock.
        name = signal.Signals(signum).name
        if stop.is_set():
            line = logs.render(
                FORCED, _stderr["format"], level=logging.WARNING, event="forced_exit", signal=name
            )
            os.write(2, line.encode())
            os._exit(EXIT_FORCED)
        stop.set()
        line = logs.render(STOPPING, _stderr["format"], level=logging.INFO, event="stopping", signal=name)
        os.write(2, line.encode())

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cmd_run(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    import psycopg

    if not settings.backends:
        raise errors.ConfigError("no backends configured: add a [backends.default] section")
    adapters = backend.build_adapters(settings.backends, settings.publish_timeout_s)
    drain_metrics = metrics.Metrics()
    if settings.metrics_listen and not args.once:
        from drain.observability import server as metrics_server

        metrics_server.serve(drain_metrics, settings)
    guard = watchdog.Watchdog(settings.watchdog_bound_s(), watchdog.Notifier(env))
    relay_ = relay.Relay(
        settings,
        adapters,
        metrics_=drain_metrics,
        failpoints_=failpoints.Failpoints(env.get("DRAIN_FAILPOINTS", "")),
        watchdog=guard,
    )
    stop = threading.Event()
    guard.start()
    try:
        with _signals(stop):
            if args.once:
                try:
                    return _run_once(relay_, stop)
                except psycopg.Error as exc:
                    raise _database_error(exc) from None
                finally:
                    relay_.shutdown()
            relay_.run(stop)
    finally:
        guard.stop()
    return EXIT_OK


def _run_once(relay_: relay.Relay, stop: threading.Event) -> int:
    """Forward what is due now, a whole batch at a time; SIGTERM stops after the current batch."""
    total = relay_.drain_due(stop)
    if total is None:
        _say("another drain is leading this table; nothing done")
        return EXIT_FAILURE
    print(
        f"drain: published {total.published}, retried {total.retried}, rejected {total.rejected}, "
        f"dead-lettered {total.dead}"
    )
    if total.skipped:
        _say(f"{total.skipped} jobs left: a backend was unavailable")
        return EXIT_FAILURE
    return EXIT_OK


def show_config(settings: config.Settings) -> None:
    """``drain check --show-config``: one line per effective key, ``key = value  # source``."""
    for key, value, source in config.describe(settings):
        print(f"{key} = {value}  # {source}")


def cmd_check(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    import psycopg

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
        db = _connect_store(settings)
        try:
            db.require_table()
            problems.extend(_schema_problems(db))
            if settings.schedules and not schedules.table_present(db):
                problems.append(f"schedules: table {db.names.schedules} does not exist; run `drain migrate`")
            if (warning := wakeup.trigger_warning(db)) is not None:
                _say(f"warning: {warning}")
            blocked, row_security = can_settle(db)
            problems.extend(  # an older schema is said above
                f"database: drain run cannot lead here: {b.detail}"
                for b in blocked
                if b.reason != settling.SCHEMA
            )
            if row_security is not None:
                problems.append(f"database: {row_security}")
        finally:
            db.close()
    except errors.DrainError as exc:
        problems.append(str(exc))
    except psycopg.Error as exc:
        problems.append(str(_database_error(exc)))
    for name, adapter in adapters.items():
        try:
            adapter.open()
            adapter.ping()
        except errors.BackendUnavailable as exc:
            problems.append(f"backend {name}: {exc}")
        finally:
            adapter.close()
    if problems:
        for problem in problems:
            _say(problem)
        return EXIT_CHECK_FAILED
    print(f"drain: ok: database and {len(adapters)} backend(s) reachable")
    return EXIT_OK


def can_settle(db: store.Store) -> tuple[list[settling.Blocker], str | None]:
    """What would keep ``drain run`` with this session's DSN and role from leading here: the
    relay's own check, and its probe (the table tested with a row of its own, or the due rows
    its first batch would take, rolled back); and what the check says about row-level security
    (settling.row_security), or None."""
    import psycopg

    check = db.settle_check()
    found = settling.blockers(check)
    if not found:
        try:
            failure = db.probe_settlement(db.settings.batch_size)
        except psycopg.Error as exc:
            found.append(settling.probe_fails(store.SELECT, errors.first_line(exc)))
        else:
            if failure is not None:
                found.append(settling.probe_fails(*failure))
    return found, settling.row_security(check)


def _schema_problems(db: store.Store) -> list[str]:
    """What `drain check` says about the table's schema version and constraints."""
    import psycopg

    try:
        version = db.schema_version()
        not_valid = db.not_valid_constraints()
    except psycopg.errors.InsufficientPrivilege as exc:
        return [
            f"cannot read the schema version ({errors.first_line(exc)}): grant SELECT on "
            f"{db.names.versions} (deploy/database/drain-role.sql)"
        ]
    except psycopg.Error as exc:
        return [f"cannot read the schema version: {errors.first_line(exc)}"]
    found = []
    if version < migrations.LATEST_VERSION:
        found.append(_older_schema(db.names.qualified, version))
    elif version > migrations.LATEST_VERSION:
        _say(
            f"warning: {db.names.qualified} is at schema version {version}, newer than this "
            f"drain's {migrations.LATEST_VERSION}"
        )
    found.extend(
        f"constraint {name} of {db.names.qualified} is NOT VALID (rows break it): run `drain migrate`"
        for name in not_valid
    )
    return found


def _older_schema(qualified: str, version: int) -> str:
    return settling.older_schema(qualified, version, migrations.LATEST_VERSION)


def cmd_status(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    import psycopg

    db = _connect_store(settings)
    try:
        db.require_table()
        figures = db.status()
        parked = db.parked()
        holder = db.leader(leadership.lock_key(settings.schema, settings.table))
        me = identity.parse(identity.application_name())
        drains = [
            d for d in map(identity.parse, db.drains()) if d is not None and d != me
        ]  # not this command
        blocked, row_security = can_settle(db)
        try:
            version: int | None = db.schema_version()
        except psycopg.errors.InsufficientPrivilege:
            version = None  # the drain's role from before versions: status works without it
    except psycopg.Error as exc:
        raise _database_error(exc) from None
    finally:
        db.close()
    report: dict[str, Any] = {
        "table": db.names.qualified,
        "schema_version": version,
        "backlog": figures["backlog"],
        "due": figures["due"],
        "future": figures["future"],
        "oldest_due_age_s": round(float(figures["oldest_due_age_s"]), 3),
        "dead": figures["dead"],
        "parked": parked,
        "leader": None if holder is None else _leader(holder),
        "standbys": _standbys(holder, drains),
        "can_lead": not blocked,
        "cannot_lead": [{"reason": b.reason, "detail": b.detail} for b in blocked],
        "warnings": [] if row_security is None else [row_security],
    }
    if args.json:
        print(json.dumps(report))
        return EXIT_OK
    leader = report["leader"]
    who = "none" if leader is None else _who(leader)
    others = ", ".join(f"{d['process']} (drain {d['version']})" for d in report["standbys"]) or "none"
    if version is not None and version < migrations.LATEST_VERSION:
        _say(_older_schema(db.names.qualified, version))
    print(
        f"table {report['table']}\n"
        f"  backlog  {report['backlog']} ({report['due']} due, {report['future']} scheduled)\n"
        f"  lag      {report['oldest_due_age_s']}s (oldest due job)\n"
        f"  dead     {report['dead']}\n"
        f"  leader   {who}\n"
        f"  standbys {others}"
    )
    if parked:
        print(
            f"  parked   {parked} (the table refused their settlement: run_at {store.PARKED_AT.isoformat()}"
            f" and last_error starting {store.PARKED_PREFIX!r}, or, parked in place, last_error starting"
            f" {store.PARKED_IN_PLACE_PREFIX!r}; see docs/drain-process.md, Settlement failures)"
        )
    if blocked:
        for blocker in blocked:
            print(f"  can lead no ({blocker.reason}): {blocker.detail}")
    else:
        print("  can lead yes (a read-write primary where this role can delete)")
    if row_security is not None:
        print(f"  warning  {row_security}")
    return EXIT_OK


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


def cmd_schedules(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    """``drain schedules``: each schedule (configured, or removed with its history) and its ticks."""
    import psycopg

    db = _connect_store(settings)
    try:
        db.require_table()
        if not schedules.table_present(db):
            raise errors.SchemaError(f"table {db.names.schedules} does not exist; run `drain migrate`")
        found = schedules.listing(db, settings.schedules)
    except psycopg.Error as exc:
        raise _database_error(exc) from None
    finally:
        db.close()

    def when(value: datetime.datetime | None) -> str | None:
        return None if value is None else value.isoformat()

    if args.json:
        print(
            json.dumps(
                [
                    {
                        **entry,
                        "last_tick": when(entry["last_tick"]),
                        "next_tick": when(entry["next_tick"]),
                        "last_job_id": None if entry["last_job_id"] is None else str(entry["last_job_id"]),
                    }
                    for entry in found
                ]
            )
        )
        return EXIT_OK
    if not found:
        print("drain: no schedules configured or recorded")
    for entry in found:
        state = "" if entry["configured"] else "\t(removed from the config)"
        print(
            f"{entry['name']}\t{entry['cron']}\t{entry['timezone']}\t"
            f"last {when(entry['last_tick']) or '-'}\tnext {when(entry['next_tick']) or '-'}{state}"
        )
    return EXIT_OK


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.StagingError(f"{what} is not valid JSON: {exc.msg}") from None


def cmd_stage(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    import psycopg

    job_args = _json_arg(args.args_json, "ARGS_JSON")
    if not isinstance(job_args, list):
        raise errors.StagingError("ARGS_JSON must be a JSON array, e.g. '[\"a@example.com\"]'")
    job = staging.Job(
        args.job_name,
        args=job_args,
        kwargs=_json_arg(args.kwargs, "--kwargs"),
        queue=args.queue,
        backend=args.backend,
        delay=datetime.timedelta(seconds=args.delay) if args.delay is not None else None,
        job_id=args.job_id,
        options=_json_arg(args.options, "--options"),
    )
    conn = store.connect(settings, autocommit=False)
    try:
        with conn.transaction():
            (job_id,) = staging.stage_many(conn, [job], table=settings.table, schema=settings.schema)
    except psycopg.errors.UndefinedTable:
        raise errors.SchemaError(
            f"table {settings.schema}.{settings.table} does not exist; run `drain migrate`"
        ) from None
    except psycopg.Error as exc:
        raise _database_error(exc) from None
    finally:
        conn.close()
    print(job_id)
    return EXIT_OK


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _dead_filter(args: argparse.Namespace) -> store.DeadFilter:
    return store.DeadFilter(
        backend=args.dead_backend,
        queue=args.dead_queue,
        job_name=args.dead_job_name,
        ids=args.ids,
        limit=args.limit,
    )


def cmd_dead(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    """``drain dead list|retry|purge``: the dead-letter table, filtered by backend/queue/job/id."""
    import psycopg

    filters = _dead_filter(args)
    if args.dead_command == "purge" and filters.everything and not args.yes:
        _say("refusing to purge every dead letter without --yes (or filter with --id/--backend/...)")
        return EXIT_NOT_CONFIRMED
    db = _connect_store(settings)
    refused = 0
    try:
        db.require_table()
        db.require_version(DEAD_ID_VERSION, "`drain dead` (dead letters numbered on their own)")
        if args.dead_command == "list":
            found = db.dead_list(filters)
        elif args.dead_command == "retry":
            count, refused = db.dead_retry(filters)
        else:
            count = db.dead_purge(filters)
    except psycopg.Error as exc:
        raise _database_error(exc) from None
    finally:
        db.close()
    if args.dead_command == "retry":
        print(f"drain: {count} dead letter(s) staged again in {db.names.qualified}")
        if refused:
            _say(
                f"{refused} dead letter(s) left: the table refuses them (they break its "
                "constraints; `drain dead list` says which); fix or purge them"
            )
    elif args.dead_command == "purge":
        print(f"drain: {count} dead letter(s) purged from {settings.dead_table}")
    elif args.json:
        print(json.dumps([_dead_json(row) for row in found]))
    else:
        for row in found:
            error = " ".join(str(row["error"]).split())
            print(
                f"{row['dead_id']}\t{row['job_id']}\t{row['job_name']}\t{row['backend']}/{row['queue']}\t"
                f"attempts={row['attempts']}\t{_when(row['dead_at'])}\t{error}"
            )
    return EXIT_OK


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
        "options": row["options"],
        "attempts": row["attempts"],
        "error": row["error"],
        "created_at": _when(row["created_at"]),
        "dead_at": _when(row["dead_at"]),
    }


def _when(value: Any) -> str:
    """A timestamp as ISO 8601, or as Postgres wrote it when ``datetime`` cannot hold it."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


COMMANDS = {
    "migrate": cmd_migrate,
    "run": cmd_run,
    "check": cmd_check,
    "status": cmd_status,
    "schedules": cmd_schedules,
    "stage": cmd_stage,
    "dead": cmd_dead,
}


def entry_point() -> None:
    sys.exit(main())

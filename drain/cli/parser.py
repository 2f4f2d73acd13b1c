"""The command line: ``drain COMMAND [flags]``, one subparser per command.

A usage mistake prints one line (``... (see `drain --help`)``) and exits EXIT_USAGE, never the
usage block.
"""

from __future__ import annotations

import argparse
from typing import Any

from drain.cli import exit_codes, output
from drain.observability import logs
from drain.version import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        output.say(f"{message} (see `drain --help`)")
        raise SystemExit(exit_codes.EXIT_USAGE)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; the flags every command shares come from ``_common``."""
    common = _common()
    parser = _Parser(prog="drain", description="A transactionally-staged job drain for Postgres.")
    parser.add_argument("--version", action="version", version=f"drain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_migrate(commands, common)
    _add_run(commands, common)
    _add_check(commands, common)
    _add_status(commands, common)
    _add_schedules(commands, common)
    _add_stage(commands, common)
    _add_allowed_jobs(commands)
    _add_dead(commands, common)
    _add_console(commands, common)
    return parser


def _common() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--config", help="TOML config file (default: $DRAIN_CONFIG)")
    common.add_argument("--dsn", help="database URL (default: $DRAIN_DSN, the file, $DATABASE_URL, PG*)")
    common.add_argument("--schema", help="schema of the staged-jobs table (default: public)")
    common.add_argument("--table", help="staged-jobs table (default: staged_jobs)")
    common.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    common.add_argument("--log-format", choices=list(logs.FORMATS), help="stderr lines (default: text)")
    return common


def _add_migrate(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
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


def _add_run(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    run = commands.add_parser("run", parents=[common], help="lead or stand by, and forward jobs")
    run.add_argument("--once", action="store_true", help="forward what is due now, then exit")
    run.add_argument("--batch-size", type=int, help="rows per batch (default: 500)")


def _add_check(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    check = commands.add_parser("check", parents=[common], help="validate the config, reach every service")
    check.add_argument(
        "--show-config",
        action="store_true",
        help="first print every effective setting and where it came from (secrets masked)",
    )


def _add_status(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    status = commands.add_parser("status", parents=[common], help="backlog, lag, dead letters, leader")
    status.add_argument("--json", action="store_true", help="print JSON")


def _add_schedules(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    listed = commands.add_parser("schedules", parents=[common], help="each schedule's last and next tick")
    listed.add_argument("--json", action="store_true", help="print JSON, one array")


def _add_stage(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    stage = commands.add_parser("stage", parents=[common], help="stage one job from the shell")
    stage.add_argument("job_name")
    stage.add_argument("args_json", nargs="?", default="[]", help="positional args, a JSON array")
    stage.add_argument("--kwargs", default="{}", help="keyword args, a JSON object")
    stage.add_argument("--queue", default="default")
    stage.add_argument("--backend", default="default")
    stage.add_argument("--delay", type=float, help="seconds from now")
    stage.add_argument("--job-id", help="the job's UUID (default: generated)")
    stage.add_argument("--options", default="{}", help="backend options, a JSON object")
    stage.add_argument(
        "--ordering-key", metavar="KEY", help="forwarded after the jobs staged earlier with this key"
    )


def _add_allowed_jobs(commands: argparse._SubParsersAction[_Parser]) -> None:
    allowed = commands.add_parser(
        "allowed-jobs",
        help="print RQ allowed_jobs: the functions these modules define (run it where the workers run)",
    )
    allowed.add_argument("modules", nargs="+", metavar="MODULE", help="a task module, e.g. app.tasks")
    allowed.add_argument("--path", default=".", help="put this directory first on sys.path (default: .)")


def _add_dead(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
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


def _add_console(commands: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    console = commands.add_parser(
        "console", parents=[common], help="serve the operator's page (extra jobdrain[console])"
    )
    console.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    console.add_argument("--port", type=positive_int, default=8089, help="port (default: 8089)")
    console.add_argument(
        "--token-file",
        metavar="PATH",
        help="the admin token, in a file (default: $DRAIN_CONSOLE_TOKEN; neither: read-only)",
    )
    console.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="a Host name the page answers besides loopback's and --host's (repeatable)",
    )

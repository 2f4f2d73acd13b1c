"""The ``drain`` command: parse, dispatch, exit codes. The only package that installs signal
handlers or reads os.environ (here, in ``main``).

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
    7  ``drain run`` did not stop within ``stop_timeout_s`` of the first SIGTERM/SIGINT (a
       database or broker stopped answering): it exited without waiting (the open batch rolled
       back; nothing lost)
    143 a second SIGTERM/SIGINT forced an immediate exit (the batch rolled back; nothing lost)

Layout: parser.py (the flags), commands/ (one module per command), signals.py (the only place
that installs signal handlers), database.py (the one way a command opens and closes a session),
output.py (the lines on stderr), serving.py (the metrics endpoint of ``drain run``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from drain import config, errors
from drain.cli import output
from drain.cli.commands import COMMANDS, allowed_jobs
from drain.cli.exit_codes import (
    EXIT_CANNOT_SETTLE,
    EXIT_CHECK_FAILED,
    EXIT_FAILURE,
    EXIT_FORCED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_STOP_DEADLINE,
    EXIT_USAGE,
)
from drain.cli.parser import build_parser
from drain.cli.signals import FORCED, STOPPING, STOPPING_LINE
from drain.observability import logs, redaction

__all__ = [
    "EXIT_CANNOT_SETTLE",
    "EXIT_CHECK_FAILED",
    "EXIT_FAILURE",
    "EXIT_FORCED",
    "EXIT_NOT_CONFIRMED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_STOP_DEADLINE",
    "EXIT_USAGE",
    "FORCED",
    "STOPPING",
    "STOPPING_LINE",
    "build_parser",
    "entry_point",
    "load_settings",
    "main",
]


def load_settings(args: argparse.Namespace, env: Mapping[str, str]) -> config.Settings:
    """The settings of one command: the config file and the environment, the flags on top."""
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
    output.set_format(logs.format_from(env))
    args = build_parser().parse_args(argv)
    output.set_format(getattr(args, "log_format", None) or output.stderr_format())
    if args.command == "allowed-jobs":  # the app's environment, not the drain's: no config
        return allowed_jobs.cmd_allowed_jobs(args)
    try:
        settings = load_settings(args, env)
        redaction.hide(_secrets(settings))
        output.set_format(settings.log_format)
        logs.configure(settings.log_level, settings.log_format, repeat_s=settings.log_repeat_s)
        handler = COMMANDS[args.command]
        return handler(args, settings, env)
    except errors.ConfigError as exc:
        output.say(f"configuration: {exc}")
        return EXIT_USAGE
    except errors.StagingError as exc:
        output.say(str(exc))
        return EXIT_USAGE
    except errors.PoolerDetected as exc:
        output.say(f"refusing to lead: {exc}")
        return EXIT_REFUSED
    except errors.CannotSettle as exc:
        output.say(f"{exc}; exiting")
        return EXIT_CANNOT_SETTLE
    except errors.DrainError as exc:
        output.say(str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FORCED
    finally:
        redaction.hide(())  # the command is over (a test may call main again in this process)


def _secrets(settings: config.Settings) -> list[str]:
    """Every fragment of the passwords this command was given (the DSN's, each URL of each backend's
    options, however nested, and the whole value of every option whose name says secret): hidden
    from every line it writes, whatever a client library quoted (redaction.hide)."""
    found = redaction.fragments(settings.dsn)
    for section in settings.backends.values():
        found.extend(_option_secrets(section.options))
    return found


def _option_secrets(value: object, name: str = "") -> list[str]:
    """The secrets in one option's value: a URL's password fragments, a secret-named key's value,
    and the same inside lists and tables (a cluster's URLs, ``sentinel_kwargs``)."""
    if isinstance(value, str):
        found = redaction.fragments(value) if "://" in value else []
        if name and redaction.is_secret_name(name) and len(value) >= redaction.MIN_FRAGMENT:
            found.append(value)
        return found
    if isinstance(value, Mapping):
        return [secret for key, item in value.items() for secret in _option_secrets(item, str(key))]
    if isinstance(value, list | tuple):
        return [secret for item in value for secret in _option_secrets(item, name)]
    return []


def entry_point() -> None:
    """The console script ``drain``."""
    sys.exit(main())

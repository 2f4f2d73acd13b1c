"""``drain console``: the operator's page on its own port (extra ``jobdrain[console]``).

Read-only unless an admin token is given (``DRAIN_CONSOLE_TOKEN`` or ``--token-file``); loopback
unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Mapping

from drain import config
from drain.cli import exit_codes, output

log = logging.getLogger(__name__)
EXTRA_LIBRARIES = ("starlette", "uvicorn", "jinja2")


def cmd_console(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    try:
        for library in EXTRA_LIBRARIES:
            importlib.import_module(library)
    except ImportError:
        output.say("`drain console` needs its extra: pip install 'jobdrain[console]'")
        return exit_codes.EXIT_USAGE
    from drain.console import access, app, serving

    token = access.token_from(env, args.token_file)
    hosts = [*app.LOOPBACK_HOSTS, args.host, *(args.allow_host or [])]
    if args.host in ("0.0.0.0", "::") and not args.allow_host:
        hosts = ["*"]  # every name this host has: say which with --allow-host to refuse the others
    console = app.build(settings, token=token, token_file=args.token_file, allowed_hosts=hosts)
    mode = "admin token required to act" if token is not None else "read-only (no admin token)"
    log.info("console on http://%s:%d for %s: %s", args.host, args.port, settings.table, mode)
    serving.serve(console, args.host, args.port)
    return exit_codes.EXIT_OK

"""``drain allowed-jobs``: the RQ ``allowed_jobs`` snippet, in the app's environment (no config)."""

from __future__ import annotations

import argparse
import sys

from drain import errors
from drain.backend import defined
from drain.cli import exit_codes, output


def cmd_allowed_jobs(args: argparse.Namespace) -> int:
    """Print ``allowed_jobs`` for the public functions the modules define (drain.backend.defined)."""
    try:
        modules = defined.import_modules(args.modules, args.path)
        sys.stdout.write(defined.toml_snippet(modules, f"drain allowed-jobs {' '.join(args.modules)}"))
    except errors.ConfigError as exc:
        output.say(str(exc))
        return exit_codes.EXIT_USAGE
    return exit_codes.EXIT_OK

"""The commands that read a configuration: ``handler(args, settings, env) -> exit code``.

``allowed-jobs`` runs in the app's environment, without a configuration (allowed_jobs.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from drain import config
from drain.cli.commands import check, console, dead, migrate, run, schedules, stage, status

Command = Callable[[argparse.Namespace, config.Settings, Mapping[str, str]], int]

COMMANDS: dict[str, Command] = {
    "migrate": migrate.cmd_migrate,
    "run": run.cmd_run,
    "check": check.cmd_check,
    "status": status.cmd_status,
    "schedules": schedules.cmd_schedules,
    "stage": stage.cmd_stage,
    "dead": dead.cmd_dead,
    "console": console.cmd_console,
}

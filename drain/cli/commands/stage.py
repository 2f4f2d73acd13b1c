"""``drain stage``: stage one job from the shell, in a transaction of its own; print its id."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import psycopg

from drain import config, errors
from drain.cli import database, exit_codes
from drain.staging import sync as staging
from drain.store import connection


def cmd_stage(args: argparse.Namespace, settings: config.Settings, env: Mapping[str, str]) -> int:
    job_args = _json_arg(args.args_json, "ARGS_JSON")
    if not isinstance(job_args, list):
        raise errors.StagingError("ARGS_JSON must be a JSON array, e.g. '[\"a@example.com\"]'")
    job = staging.Job(
        args.job_name,
        args=job_args,
        kwargs=_json_arg(args.kwargs, "--kwargs"),
        queue=args.queue,
        backend=args.backend,
        delay=args.delay,  # seconds: staging checks the range (nan, 1e300: one line)
        job_id=args.job_id,
        options=_json_arg(args.options, "--options"),
        ordering_key=args.ordering_key,  # staging checks it (blank, over 255 bytes: one line)
    )
    with database.connected(connection.connect(settings, autocommit=False)) as conn:
        try:
            with conn.transaction():
                (job_id,) = staging.stage_many(conn, [job], table=settings.table, schema=settings.schema)
        except psycopg.errors.UndefinedTable:
            raise errors.SchemaError(
                f"table {settings.schema}.{settings.table} does not exist; run `drain migrate`"
            ) from None
    print(job_id)
    return exit_codes.EXIT_OK


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.StagingError(f"{what} is not valid JSON: {exc.msg}") from None
    except ValueError as exc:  # an integer past Python's 4,300 digits
        raise errors.StagingError(f"{what} is not valid JSON: {errors.first_line(exc)}") from None

"""The demo's job: what an app's RQ worker would import and run.

It records that it ran (job id and argument) in the demo database, so the demo can show exactly
which staged jobs reached a worker.
"""

from __future__ import annotations

import os

import psycopg
import rq


def send_welcome_email(user_id: int, email: str) -> str:
    job = rq.get_current_job()
    job_id = job.id if job is not None else None
    with psycopg.connect(os.environ["DEMO_DSN"]) as conn:
        conn.execute(
            "INSERT INTO demo_runs (job_id, user_id, email) VALUES (%s, %s, %s)",
            [job_id, user_id, email],
        )
    return f"welcome mail to {email}"

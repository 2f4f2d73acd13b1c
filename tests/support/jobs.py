"""A staged row as the relay hands it to a backend, for adapter tests that need no table."""

from __future__ import annotations

import datetime
import uuid

from drain import models


def staged(row_id: int, queue: str, job_name: str = "json.dumps") -> models.StagedJob:
    """Row ``row_id`` of ``queue``: ``job_name([row_id])``, a fresh job id, created now."""
    return models.StagedJob(
        id=row_id,
        job_id=uuid.uuid4(),
        job_name=job_name,
        args=[row_id],
        kwargs={},
        queue=queue,
        backend="default",
        options={},
        created_at=datetime.datetime.now(datetime.UTC),
    )

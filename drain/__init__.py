"""drain: a transactionally-staged job drain for Postgres.

Stage jobs as rows in the same transaction as your data; one leader-elected drain process
forwards committed rows to RabbitMQ, RQ or Celery and deletes them only after the broker
acknowledged them.
"""

from drain.errors import (
    BackendUnavailable,
    ConfigError,
    DrainError,
    LeadershipLost,
    PoolerDetected,
    SchemaError,
    StagingError,
)
from drain.models import Outcome, PublishResult, StagedJob
from drain.staging.aio import astage, astage_many
from drain.staging.conn import AutocommitWarning
from drain.staging.sync import Job, Staged, stage, stage_many
from drain.version import __version__

__all__ = [
    "AutocommitWarning",
    "BackendUnavailable",
    "ConfigError",
    "DrainError",
    "Job",
    "LeadershipLost",
    "Outcome",
    "PoolerDetected",
    "PublishResult",
    "SchemaError",
    "Staged",
    "StagedJob",
    "StagingError",
    "__version__",
    "astage",
    "astage_many",
    "stage",
    "stage_many",
]

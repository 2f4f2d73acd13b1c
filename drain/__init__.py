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
from drain.staging import Job, stage, stage_many

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "DrainError",
    "Job",
    "LeadershipLost",
    "Outcome",
    "PoolerDetected",
    "PublishResult",
    "SchemaError",
    "StagedJob",
    "StagingError",
    "__version__",
    "stage",
    "stage_many",
]

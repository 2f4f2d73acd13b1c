"""A task module as real apps write them, for the ``allowed_jobs`` tests (issue 22).

It defines one task, ``greet``, and imports what it needs besides — here
``subprocess.check_output`` and ``tests.support.tasks.record``. An RQ worker resolves
``tests.support.hostile_tasks.check_output`` by import and getattr, so that name is a shell: no
documented configuration may let a row reach it. ``app`` (the tests' Celery app) lets a
``celery worker -A tests.support.hostile_tasks`` import this module too.
"""

from __future__ import annotations

from subprocess import check_output  # noqa: F401 - imported on purpose: the attack's target
from typing import Any

from tests.support import tasks
from tests.support.celery_tasks import app  # noqa: F401 - for `celery -A tests.support.hostile_tasks`
from tests.support.tasks import record  # noqa: F401 - imported: defined in another module


def greet(*args: Any, **kwargs: Any) -> str:
    """The one task this module defines: record the run like tests.support.tasks.record."""
    return tasks.record(*args, **kwargs)

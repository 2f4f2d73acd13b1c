"""A job class for ``rq worker`` that runs only functions the module named in the job defines.

``rq worker --job-class drain_adapters.rq.job.CheckedJob ...`` (the worker's environment needs
``jobdrain[rq]``). RQ resolves a job's ``func_name`` (``app.tasks.send_email``) by importing
``app.tasks`` and taking the attribute, so a name can reach anything the module imports
(``app.tasks.check_output`` is ``subprocess.check_output`` when ``app/tasks.py`` imports it).
This class refuses, on the worker and before the call, a job whose function is not a plain
function defined in the module its name gives (``drain.backend.defined.defines``): the job fails with
:class:`NotDefinedHere` (RQ keeps it in its failed-job registry with that reason) and nothing
runs. It is what makes wildcard ``allowed_jobs`` safe (``wildcards_with_checked_workers``), and
defence in depth with exact names. Jobs of a method on an instance (RQ's ``instance``, which
drain never writes) are left as RQ runs them.
"""

from __future__ import annotations

from typing import Any

from rq import job as rq_job

from drain.backend import defined


class NotDefinedHere(Exception):
    """The job names a callable its module does not define (an import, a builtin, an object)."""


class CheckedJob(rq_job.Job):
    """An RQ Job whose ``func`` must be a function defined in the module its name gives."""

    @property
    def func(self) -> Any:
        func = super().func
        name = self.func_name
        if not self.instance and isinstance(name, str):  # as RQ decides between the two
            module_name, _, attribute = name.rpartition(".")
            if not (defined.is_public(attribute) and defined.defines(module_name, func)):
                where = getattr(func, "__module__", None)
                origin = f"{where}.{getattr(func, '__qualname__', '?')}" if where else type(func).__name__
                raise NotDefinedHere(
                    f"job {name!r} refused: it resolves to {origin}, which {module_name or 'no module'} "
                    "does not define (drain_adapters.rq.job.CheckedJob runs only functions defined "
                    "in the module the job names)"
                )
        return func

"""The former path of the RQ job class, ``drain_adapters.rq_job.CheckedJob``: workers started with
it keep working. New command lines name ``drain_adapters.rq.job.CheckedJob``."""

from drain_adapters.rq.job import CheckedJob, NotDefinedHere

__all__ = ["CheckedJob", "NotDefinedHere"]

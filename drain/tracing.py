"""What a worker imports to continue the staging transaction's trace: kept at this name for workers.

``extract(headers)`` (a pika or Celery consumer) and ``context_from_rq_job(job)`` (an RQ job) are
documented since 0.1.0 under ``drain.tracing``; the module itself is ``drain.observability.tracing``.
"""

from drain.observability.tracing import context_from_rq_job, extract

__all__ = ["context_from_rq_job", "extract"]

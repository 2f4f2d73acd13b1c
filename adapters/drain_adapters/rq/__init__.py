"""The RQ backend (``type = "rq"``): each staged job becomes a real RQ job (``adapter``).

The units: ``adapter`` (settings and the adapter, which orders the rest), ``rules`` (what RQ and
its worker accept, pure), ``message`` (a row to the hash fields RQ writes, pure), ``script`` (the
batch's one Lua call) and ``job`` (``CheckedJob``, the job class for ``rq worker --job-class``).
Redis itself (client, errors, Sentinel settings) is ``drain_adapters.redis``, shared with Celery.
"""

from drain_adapters.rq.adapter import DEFAULT_URL, RQAdapter, RQSettings

__all__ = ["DEFAULT_URL", "RQAdapter", "RQSettings"]

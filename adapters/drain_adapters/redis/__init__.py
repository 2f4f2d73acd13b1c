"""What the two Redis users (the RQ backend, Celery on Redis) share: the client by URL or Sentinel
(``client``), the one classification of Redis's error replies (``errors``) and the Sentinel and
``wait_replicas`` settings (``settings``)."""

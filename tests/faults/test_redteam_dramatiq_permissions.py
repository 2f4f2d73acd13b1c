"""Red team (Dramatiq backend on RabbitMQ): one row's queue outside the drain user's permissions
stalls the whole backend.

RabbitMQ permissions are regular expressions over resource names; least privilege for the
drain's user is "configure and write the app's queues" (here ``^rtq-ok(\\.DQ|\\.XQ)?$``). The adapter
declares each row's queue before publishing; a row naming another queue (its ``queue`` column is
the app's data) gets ACCESS_REFUSED on ``queue.declare``, which ``rabbitmq_link`` classes as
"one of the drain's permissions": BackendUnavailable, the connection dropped, every row of the
batch untouched. The refused row is first in every batch, so no row of any queue is ever
published again (G6: "a row that cannot be delivered, by its own fault, never blocks the rows
behind it"; the same for a queue the vhost's permissions do not cover for configuration). The
NATS backend does the same with a subject permission (test_redteam_nats_refusals.py).

Expected: that row's queue's jobs wait (RETRY, a queue-wide refusal) or the row is rejected, and
the rows of permitted queues are delivered.
"""

from __future__ import annotations

from drain_adapters import dramatiq

from drain import errors, models
from tests.support import jobs, rabbit

ACTOR = "app.record"


def test_one_row_on_a_queue_the_user_may_not_declare_does_not_stall_the_backend() -> None:
    rabbit.need_rabbitmq()
    with rabbit.own_vhost() as (url, vhost, user):
        rabbit.ctl(
            "set_permissions", "-p", vhost, user, r"^rtq-ok(\.DQ|\.XQ)?$", r"^(amq\.default|rtq-ok)$", ".*"
        )
        backend = dramatiq.DramatiqAdapter.from_options(
            "d", {"url": url, "allowed_actors": [ACTOR]}, publish_timeout_s=5
        )
        outcomes: list[object] = []
        try:
            backend.open()
            for _round in range(2):
                batch = [jobs.staged(1, "rtq-other", ACTOR)] + [
                    jobs.staged(n, "rtq-ok", ACTOR) for n in range(2, 12)
                ]
                try:
                    outcomes.append([result.outcome for result in backend.publish_batch(batch)])
                except errors.BackendUnavailable as exc:
                    outcomes.append(f"outage: {exc}")
        finally:
            backend.close()
    for got in outcomes:
        assert not isinstance(got, str), got
        assert isinstance(got, list) and got[1:] == [models.Outcome.PUBLISHED] * 10, got

"""Red team (Dramatiq backend on RabbitMQ): a queue name of 253-255 characters is an outage.

``message.queue_problem`` allows a queue name of up to 255 bytes (AMQP's short string), but the
adapter declares, for each queue, Dramatiq's ``<queue>.DQ`` and ``<queue>.XQ`` too: three bytes
longer. For a name of 253 to 255 characters pika raises ShortStringTooLong while encoding the
declaration; the link classes it as a lost link: BackendUnavailable, the connection dropped,
every row of the batch untouched. The row (its ``queue`` is the app's data) is first in every
batch, so the whole backend stalls for ever and nothing is dead-lettered (G6: "a row that cannot
be delivered, by its own fault, never blocks the rows behind it"; the operator sees a backend
outage, not a bad row).

Expected: the row REJECTED with a reason (its queue name leaves no room for .DQ/.XQ), the rows
beside it published.
"""

from __future__ import annotations

import pytest
from drain_adapters import dramatiq

from drain import errors, models
from tests.support import jobs, rabbit

ACTOR = "app.record"


def test_a_queue_name_too_long_for_its_delay_queue_is_that_rows_rejection() -> None:
    rabbit.need_rabbitmq()
    with rabbit.own_vhost() as (url, _vhost, _user):
        backend = dramatiq.DramatiqAdapter.from_options(
            "d", {"url": url, "allowed_actors": [ACTOR]}, publish_timeout_s=5
        )
        try:
            backend.open()
            batch = [jobs.staged(1, "q" * 254, ACTOR), jobs.staged(2, "fine", ACTOR)]
            try:
                results = {result.row_id: result.outcome for result in backend.publish_batch(batch)}
            except errors.BackendUnavailable as exc:
                pytest.fail(f"one row's queue name made the backend unavailable: {str(exc)[:120]}")
        finally:
            backend.close()
    assert results == {1: models.Outcome.REJECTED, 2: models.Outcome.PUBLISHED}

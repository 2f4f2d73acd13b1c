"""Delivery tags to outcomes (drain_adapters.amqp.confirms), with no broker: the frames a
channel in confirm mode receives, replayed as calls."""

from __future__ import annotations

import datetime
import time
import uuid

from drain_adapters.amqp import confirms as amqp_confirms

from drain import models

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def jobs(count: int, start: int = 1) -> list[models.StagedJob]:
    return [
        models.StagedJob(n, uuid.uuid4(), "app.x", [], {}, "q", "events", {}, NOW)
        for n in range(start, start + count)
    ]


def outcomes(ticket: amqp_confirms.Ticket) -> dict[int, models.Outcome]:
    return {result.row_id: result.outcome for result in ticket.results}


def send(tracker: amqp_confirms.ConfirmTracker, batch: list[models.StagedJob]) -> amqp_confirms.Ticket:
    ticket = amqp_confirms.Ticket()
    for job in batch:
        tracker.sent(ticket, job)
    return ticket


def test_a_multiple_ack_settles_every_earlier_tag_across_tickets() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    first, second = send(tracker, jobs(3)), send(tracker, jobs(3, start=4))
    tracker.confirmed(4, multiple=True, acked=True)
    assert outcomes(first) == dict.fromkeys((1, 2, 3), models.Outcome.PUBLISHED)
    assert first.settled and first.confirmed
    assert outcomes(second) == {4: models.Outcome.PUBLISHED}
    assert not second.settled and tracker.outstanding == 2
    tracker.confirmed(6, multiple=False, acked=False)  # tag 6 only: tag 5 stays pending
    assert outcomes(second) == {4: models.Outcome.PUBLISHED, 6: models.Outcome.RETRY}
    assert list(second.pending) == [5]


def test_a_returned_message_is_rejected_when_its_ack_comes() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    batch = jobs(2)
    ticket = send(tracker, batch)
    tracker.returned(str(batch[1].job_id), "unroutable: 312 NO_ROUTE")
    tracker.confirmed(2, multiple=True, acked=True)
    assert outcomes(ticket) == {1: models.Outcome.PUBLISHED, 2: models.Outcome.REJECTED}
    assert [r.error for r in ticket.results if r.row_id == 2] == ["rabbitmq: unroutable: 312 NO_ROUTE"]


def test_a_returned_message_of_a_queue_the_drain_declares_is_retried_uncounted() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    batch = jobs(2)
    ticket = send(tracker, batch)
    tracker.returned(str(batch[0].job_id), "unroutable: 312 NO_ROUTE; declaring it again", retry=True)
    tracker.returned(str(batch[1].job_id), "unroutable: 312 NO_ROUTE")
    tracker.confirmed(2, multiple=True, acked=True)
    assert outcomes(ticket) == {1: models.Outcome.RETRY, 2: models.Outcome.REJECTED}


def test_a_probe_takes_a_tag_and_its_confirm_is_kept_apart() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    tracker.probe_sent()  # tag 1
    assert tracker.probe is None
    ticket = send(tracker, jobs(2))  # tags 2, 3
    assert list(ticket.pending) == [2, 3]
    tracker.confirmed(2, multiple=True, acked=True)  # covers the probe and the first job
    assert tracker.probe is True
    assert outcomes(ticket) == {1: models.Outcome.PUBLISHED}
    tracker.probe_sent()  # tag 4
    tracker.confirmed(4, multiple=False, acked=False)
    assert tracker.probe is False
    assert list(ticket.pending) == [3]


def test_a_lost_channel_leaves_the_unconfirmed_jobs_unconfirmed_and_tags_restart() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    ticket = send(tracker, jobs(3))
    tracker.confirmed(1, multiple=False, acked=True)
    tracker.abandon("connection closed", retry=False)
    assert ticket.settled and ticket.lost == "connection closed" and not ticket.lost_retry
    assert list(ticket.pending) == [2, 3]  # never confirmed: collect decides what they become
    tracker.confirmed(3, multiple=True, acked=True)  # a late confirm of the old channel
    assert outcomes(ticket) == {1: models.Outcome.PUBLISHED}

    tracker.restart()
    fresh = send(tracker, jobs(1, start=10))
    assert list(fresh.pending) == [1]
    tracker.confirmed(1, multiple=False, acked=True)
    assert outcomes(fresh) == {10: models.Outcome.PUBLISHED}


def test_a_new_channel_loses_what_the_old_one_carried_as_retry() -> None:
    tracker = amqp_confirms.ConfirmTracker()
    ticket = send(tracker, jobs(2))
    tracker.restart()
    assert ticket.lost == "the channel was replaced" and ticket.lost_retry
    assert tracker.outstanding == 0


def test_a_channel_closed_over_a_message_size_refuses_that_job_and_retries_its_neighbours() -> None:
    """The close names the sizes, not the message: the jobs over the limit are found by their
    recorded body sizes across every ticket on the channel; the others are retried."""
    reply = "PRECONDITION_FAILED - message size 70000 is larger than configured max size 65536"
    limit = amqp_confirms.oversize_limit(reply)
    assert limit == 65536
    assert amqp_confirms.oversize_limit("PRECONDITION_FAILED - message size 2 is larger than max size 1") == 1
    assert amqp_confirms.oversize_limit("PRECONDITION_FAILED - inequivalent arg 'durable'") is None
    tracker = amqp_confirms.ConfirmTracker()
    first, second = amqp_confirms.Ticket(), amqp_confirms.Ticket()
    batch = jobs(4)
    tracker.sent(first, batch[0], 100)
    tracker.sent(first, batch[1], 70_000)
    tracker.sent(second, batch[2], 100)
    tracker.sent(second, batch[3], 100)
    tracker.confirmed(1, multiple=False, acked=True)
    tracker.refuse_larger(limit, f"refused by the broker: {reply}")
    assert first.settled and second.settled and tracker.outstanding == 0
    one, _ = amqp_confirms.close_out(first, "rabbitmq")
    two, down = amqp_confirms.close_out(second, "rabbitmq")
    assert down is None  # the connection lives: nothing of this is an outage
    assert {r.row_id: r.outcome for r in one + two} == {
        1: models.Outcome.PUBLISHED,
        2: models.Outcome.REJECTED,
        3: models.Outcome.RETRY,
        4: models.Outcome.RETRY,
    }
    assert [r.error for r in one if r.row_id == 2] == [f"rabbitmq: refused by the broker: {reply}"]


def test_the_wait_for_a_ticket_counts_from_its_submission() -> None:
    """Collecting several tickets in one step waits one publish timeout at most, not one each."""
    assert amqp_confirms.Ticket().remaining_s(10.0) == 10.0
    assert amqp_confirms.Ticket(deadline=time.monotonic() - 1).remaining_s(10.0) == 0.0
    assert 4.0 < amqp_confirms.Ticket(deadline=time.monotonic() + 5).remaining_s(10.0) <= 5.0


def test_jobs_never_written_retry_and_give_their_tags_back() -> None:
    """A batch whose tail was left unwritten (no time left to write it): those jobs RETRY (no
    attempt) and the next message written takes the first tag given back, as the broker numbers
    it; the written head is confirmed as usual."""
    tracker = amqp_confirms.ConfirmTracker()
    earlier = send(tracker, jobs(2))  # tags 1-2, in flight
    ticket = send(tracker, jobs(5, start=3))  # tags 3-7
    tracker.unsent(ticket, 3, "rabbitmq: not sent")  # jobs 5, 6, 7 never written
    assert [(r.row_id, r.outcome) for r in ticket.results] == [(n, models.Outcome.RETRY) for n in (5, 6, 7)]
    assert list(ticket.pending) == [3, 4] and tracker.outstanding == 4
    following = send(tracker, jobs(1, start=8))
    assert list(following.pending) == [5]  # the broker's tag for the next message it receives
    tracker.confirmed(5, multiple=True, acked=True)
    assert outcomes(earlier) == dict.fromkeys((1, 2), models.Outcome.PUBLISHED)
    assert outcomes(ticket) == {
        3: models.Outcome.PUBLISHED,
        4: models.Outcome.PUBLISHED,
        5: models.Outcome.RETRY,
        6: models.Outcome.RETRY,
        7: models.Outcome.RETRY,
    }
    assert outcomes(following) == {8: models.Outcome.PUBLISHED}
    assert ticket.settled and following.settled and tracker.outstanding == 0

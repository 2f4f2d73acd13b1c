"""The rows whose settlement the table refused (G6: no row blocks the rest).

If the table refused every row not already known to be refused, it may be the table rather than
those rows: the same kinds of write are tried on a row of the drain's own
(drain.store.session.Batch.test_table), or, when it cannot write one, on the other due rows,
each alone until one takes it (rolled back). If the table refuses them too, or there is no other
row to tell, the whole settlement fails (SettlementRefused: nothing written, nothing new
published, drain.relay.settling). Otherwise each refused row is its own matter, however many:

- a published one (the table refused its DELETE) or a dead one (its burial) is parked
  (drain.store.session.Batch.park), never selected again, or, when the table refuses that too
  (an app's CHECK on run_at), parked in place (Batch.park_in_place: only last_error, which every
  select skips);
- one refused by an error that may pass (a lock wait, a serialization failure), whose parking in
  place is refused too, or whose backoff UPDATE was refused, is held by this process
  (Unsettled, without its content, capped), out of selection, and its settlement tried again
  with a backoff of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from drain import errors, models
from drain.relay import settlement, settling
from drain.store import session as store

Parked = list[tuple[models.StagedJob, str]]


def kinds(fresh: list[models.StagedJob], published: set[int], dead: dict[int, settlement.Dead]) -> list[str]:
    """The kinds of write the settlement of ``fresh`` asked of the table, in probing order."""
    asked = {
        store.DELETE if j.id in published else store.BURY if j.id in dead else store.RETRY for j in fresh
    }
    return [kind for kind in store.PROBE_KINDS if kind in asked]


def table_refuses(
    batch: store.Batch,
    kinds_: list[str],
    fresh: list[models.StagedJob],
    refused: store.Refused,
    *,
    exclude: list[int],
    batch_size: int,
    paused: Callable[[], list[str]],
) -> None:
    """Every fresh row of a settlement was refused: raise SettlementRefused if the table refuses
    these kinds of write whichever row they name (a row of the drain's own; the other due rows,
    not in ``exclude``, when it cannot write one)."""
    test = batch.test_table(kinds_)
    if test.failure is not None:
        raise errors.SettlementRefused(settling.refused_by_table(len(fresh), *test.failure))
    if test.tested:
        return
    probed, failure = batch.probe_due(batch_size, paused(), exclude, kinds_)
    if not probed:
        raise errors.SettlementRefused(
            f"the table refused the settlement of all {len(fresh)} rows (no row of its own, nor "
            f"another due row, to tell whether it refuses every row): {refused[fresh[0].id].why}"
        )
    if failure is not None:
        raise errors.SettlementRefused(settling.refused_by_table(len(fresh), *failure))


def park_or_hold(
    batch: store.Batch,
    jobs: list[models.StagedJob],
    refused: store.Refused,
    published: set[int],
    dead: dict[int, settlement.Dead],
) -> tuple[list[models.StagedJob], Parked]:
    """Park each refused row of ``jobs`` or hold it (the module docstring); return (held, parked)."""
    held: list[models.StagedJob] = []
    parked: Parked = []
    for job in jobs:
        if job.id not in refused:
            continue
        why, passing = refused[job.id]
        if job.id in published:
            note = f"published to backend {job.backend}, but the table refused its DELETE: {why}"
        elif job.id in dead:
            row = dead[job.id]
            note = f"dead after {row.attempts} attempts ({row.error}); the table refused its burial: {why}"
        else:
            held.append(job)  # its backoff was refused: tried again, it was not delivered
            continue
        if passing:
            held.append(job)  # a lock wait, a serialization failure: written again, not parked
            continue
        if batch.park(job, f"{store.PARKED_PREFIX} {note}"):
            parked.append((job, f"{store.PARKED_PREFIX} {note}"))
            continue
        note = (
            f"{store.PARKED_IN_PLACE_PREFIX} {note}; the table refused its parking (run_at "
            f"{store.PARKED_AT.date()}) too, so its run_at stays"
        )
        if batch.park_in_place(job, note):
            parked.append((job, note))
        else:
            held.append(job)
    return held, parked

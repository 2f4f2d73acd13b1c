"""Settle or do not publish: whether this drain can delete what it would publish, and the
settlements it decided but could not write yet.

::

    try the lead ──► settle_check: in recovery? read-only? an older schema? privileges?
                          │                                        ──any──► stand by, say why
                          │ none          (row-level security for the role: a warning)
                          ▼
                     take the lock; test the table, rolled back (the probe): the lock its writes
                     take, then a row of the drain's own — its SELECT sees it, each kind of
                     settlement (DELETE, retry UPDATE, burial) of it is taken; without INSERT on
                     the table, the first batch's due rows instead, each alone until one takes it
                     ──a kind refused──► release the lock, stand by, say which write and why
                          │ each kind taken
                          ▼
                     publish, settle ──a part refused──► the same test of the table, then:
                          │                 refused too: the whole settlement fails (below)
                          │                 taken (or no row of its own, and another due row
                          │                 takes it): each row alone; a refused row is parked
                          │                 (run_at far ahead, why in last_error), or held
                          │                 (Unsettled, backoff) when the error may pass
                          │                 (40xxx, 55P03, 57014) or its parking is refused;
                          │                 the rest is written and flows
                          │
                          └─ the whole settlement fails (the table refuses: a trigger or policy
                             for every row, a lock, a privilege, read-only, a full disk)
                               ──► Unsettled, ``failing``: its rows are excluded from selection;
                                   only their settlement is tried again, with backoff, its lock
                                   waits bounded by the time left; nothing new is published
                                   until it is written

Whether the *table* refuses is never decided from one row's error, its SQLSTATE least of all:
only from a write the table refuses whichever row it names (the drain's own row, its lock).
A reason other than ``recovery`` (a standby server, a normal place for a drain to wait in a
cluster) and ``schema`` (a table older than this drain: it waits for ``drain migrate``, as a
rolling upgrade that starts the new drain first does) that lasts ``settle_timeout_s`` ends
``drain run`` with exit status 6, at that moment (the relay never waits past it). On an older
schema the drain must not lead: its settlements are written for the current one (0.1.0's dead
letters are keyed by the staged row's id, and a burial of an id already dead failed its whole
batch, every step). The bound this keeps: under a persistent settlement failure each
row is published at most twice — once before the failure was known (the batch and the batches in
flight when it began), once more after it is healed if the process exited meanwhile (its memory
of what it published dies with it; a restarted drain meets the same failure in its check or its
probe and publishes nothing). A row the table refuses alone is published once and parked, in
the table: never selected again, also by a restarted drain.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from drain import models
from drain.relay import backoff, settlement
from drain.store import connection, writes

RECOVERY = "recovery"
READ_ONLY = "read_only"
SCHEMA = "schema"
PRIVILEGES = "privileges"
SELECT_FAILS = "select_fails"
DELETE_FAILS = "delete_fails"
RETRY_FAILS = "retry_fails"
BURY_FAILS = "bury_fails"
SETTLEMENT_FAILED = "settlement_failed"
REASONS = (
    RECOVERY,
    READ_ONLY,
    SCHEMA,
    PRIVILEGES,
    SELECT_FAILS,
    DELETE_FAILS,
    RETRY_FAILS,
    BURY_FAILS,
    SETTLEMENT_FAILED,
)
"""Every reason, the values of the ``reason`` label of ``drain_cannot_settle``."""
_PROBED = {  # the probe's kind of write (drain.store.writes.PROBE_KINDS, SELECT): its reason, what it tried
    kind: (reason, writes.TRIED[kind])
    for kind, reason in (
        (writes.SELECT, SELECT_FAILS),
        (writes.DELETE, DELETE_FAILS),
        (writes.RETRY, RETRY_FAILS),
        (writes.BURY, BURY_FAILS),
    )
}

RETRY_MIN_S = 0.5
RETRY_MAX_S = connection.SETTLEMENT_RETRY_MAX_S
REFUSED_MAX_S = 60.0  # the longest wait between two tries of a held row's settlement
MAX_HELD_ROWS = 10_000
MAX_HELD_BYTES = 8 << 20
"""The most the process holds (Unsettled): past either, the table refuses most rows' settlement,
and it counts as the settlement failing (nothing new is published; exit 6 after
settle_timeout_s). 8 MiB is within the slack of the memory bound's base (64 MiB, measured 42-56
MB idle): the held rows never take the drain past base + 3 x batch_max_bytes."""
HELD_ROW_BYTES = 1024
"""What one held row takes beyond its names' and its error's text (the job without its content,
its result, their entries): measured about 900 bytes (tests/unit/test_settlement.py)."""
_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Blocker:
    """Why this drain cannot settle where it is connected: ``reason`` (one of REASONS, a metric
    label) and ``detail`` (one line for logs, ``drain status`` and ``drain check``)."""

    reason: str
    detail: str

    @property
    def unbounded(self) -> bool:
        """A standby server (waiting for a failover) or an older schema (waiting for `drain
        migrate`): standing by for it is normal and has no time bound."""
        return self.reason in (RECOVERY, SCHEMA)


def blockers(check: Mapping[str, Any]) -> list[Blocker]:
    """What a ``Store.settle_check`` row says stands in the way, most fundamental first."""
    found: list[Blocker] = []
    if check["in_recovery"]:
        found.append(
            Blocker(RECOVERY, "the server is a standby (in recovery): a drain leads only on the primary")
        )
    elif check["read_only"]:
        found.append(
            Blocker(
                READ_ONLY,
                "the session is read-only (transaction_read_only is on: default_transaction_read_only "
                "in the DSN, the role, the database or the server): it cannot delete what it publishes",
            )
        )
    version, latest = check.get("schema_version"), check.get("latest_version")
    if version is not None and latest is not None and 0 < version < latest and not check["in_recovery"]:
        found.append(Blocker(SCHEMA, older_schema(check["table"], version, latest)))
    missing = [
        f"{', '.join(check[f'{table}_missing'])} on {check[table]}"
        for table in ("table", "dead", "versions")
        if check.get(f"{table}_missing")
    ]
    if missing and not check["in_recovery"]:
        found.append(
            Blocker(PRIVILEGES, f"role {check['role']} lacks {'; '.join(missing)}: it cannot settle")
        )
    return found


def older_schema(table: str, version: int, latest: int) -> str:
    """The line that says a table is older than this drain."""
    return f"{table} is at schema version {version}, this drain expects {latest}: run `drain migrate`"


def row_security(check: Mapping[str, Any]) -> str | None:
    """What a ``Store.settle_check`` row says about row-level security, or None: policies that
    apply to the drain's role decide which rows it sees, and a row they hide is never forwarded,
    with no error anywhere. Not a Blocker (a policy may admit every row): ``drain check`` fails
    on it, ``drain status`` and the leader's log warn."""
    if not check.get("row_security"):
        return None
    return (
        f"row-level security applies to role {check['role']} on {check['table']}: a row its "
        "policies hide from the drain is never forwarded (give the role a policy USING (true), "
        "or BYPASSRLS; docs/operations/database.md, Row-level security)"
    )


def probe_fails(kind: str, detail: str, target: str = "due rows") -> Blocker:
    """The probe's ``kind`` of write (drain.store.session.PROBE_KINDS, or the read of a row of its own)
    of its ``target`` was refused, for ``detail``."""
    reason, what = _PROBED[kind]
    return Blocker(reason, f"{what} of {target} (rolled back) failed: {detail}")


refused_by_table = writes.refused_by_table


def settlement_failed(jobs: int, error: BaseException) -> Blocker:
    return Blocker(
        SETTLEMENT_FAILED, f"{jobs} published jobs could not be settled (deleted): {_first_line(error)}"
    )


def too_many_held(jobs: int, held_bytes: int) -> Blocker:
    return Blocker(
        SETTLEMENT_FAILED,
        f"{jobs} published jobs ({held_bytes >> 10} KiB) held by the process: the table refused their "
        f"settlement, their parking and their parking in place; past the cap of {MAX_HELD_ROWS} rows "
        f"or {MAX_HELD_BYTES >> 20} MiB the table refuses most rows' settlement",
    )


def slim(job: models.StagedJob) -> models.StagedJob:
    """What a held job keeps: what its settlement needs (ids, names, attempts, times), not its
    content (arguments, options, trace context): a settlement names rows, a burial copies the
    row from the table."""
    return dataclasses.replace(
        job, args=(), kwargs=_EMPTY, options=_EMPTY, traceparent=None, tracestate=None, memory_bytes=0
    )


def _kept(result: models.PublishResult) -> models.PublishResult:
    """A result as held: its error cut to what a settlement writes (settlement.MAX_ERROR_CHARS)."""
    if result.error is None or len(result.error) <= settlement.MAX_ERROR_CHARS:
        return result
    return dataclasses.replace(result, error=result.error[: settlement.MAX_ERROR_CHARS])


def held_bytes(job: models.StagedJob, result: models.PublishResult) -> int:
    """An upper estimate of what one held job and its result take: HELD_ROW_BYTES, and each text
    at a byte a character if ASCII, else 4 (a UCS-4 string): Python's own sizes."""
    texts = (job.job_name, job.queue, job.backend, job.unreadable or "", result.error or "")
    return HELD_ROW_BYTES + sum(len(text) if text.isascii() else 4 * len(text) for text in texts)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Unsettled:
    """Jobs already handed to their backend, with their results, whose settlement is not written
    yet, by row id; a later step writes them and forgets them. Three kinds:

    - deferred: another transaction holds the row (not a failure); written by the next step;
    - refused: the table refused this row's settlement, and its parking (drain.relay.loop); tried
      again after a backoff of its own (RETRY_MIN_S doubling to REFUSED_MAX_S), the rest flows;
    - ``failing``: the whole settlement of a step failed; the relay publishes nothing new and
      tries it again after ``wait_s()``.

    Every row held here is excluded from selection. A job is held without its content (``slim``),
    and the rows held are capped (MAX_HELD_ROWS, MAX_HELD_BYTES: ``crowded``).
    """

    def __init__(self, *, clock: Callable[[], float], rand: Callable[[], float]) -> None:
        self._jobs: dict[int, models.StagedJob] = {}
        self._results: dict[int, models.PublishResult] = {}
        self._bytes = 0  # held_bytes of every job held
        self._max_rows = MAX_HELD_ROWS
        self._max_bytes = MAX_HELD_BYTES
        self._refused: dict[int, tuple[int, float]] = {}  # row id -> (times refused, next try at)
        self._clock = clock
        self._retries = backoff.Streak(backoff.Backoff(RETRY_MIN_S, RETRY_MAX_S, rand))
        self._refused_backoff = backoff.Backoff(RETRY_MIN_S, REFUSED_MAX_S, rand)
        self._next_at = 0.0
        self.failing = False
        self.over_cap = False  # failing because crowded (crowded_out), not for a failed write

    def __bool__(self) -> bool:
        return bool(self._jobs)

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    @property
    def bytes(self) -> int:
        """An upper estimate of what the jobs held take (held_bytes)."""
        return self._bytes

    def crowded(self) -> bool:
        """Whether the process holds as many rows as it may (MAX_HELD_ROWS, MAX_HELD_BYTES): the
        relay then selects nothing new, as when a settlement fails."""
        return len(self._jobs) >= self._max_rows or self._bytes >= self._max_bytes

    def held(self) -> list[models.StagedJob]:
        """The jobs held, as held (``slim``)."""
        return list(self._jobs.values())

    def row_ids(self) -> list[int]:
        return list(self._jobs)

    def refused_ids(self) -> set[int]:
        """The rows held because the table refused their settlement."""
        return set(self._refused)

    def pending(self) -> tuple[list[models.StagedJob], dict[int, models.PublishResult]]:
        """The jobs to settle in the next step, with their results (still held here until then):
        all but the refused ones whose backoff is not up."""
        now = self._clock()
        due = [job for row_id, job in self._jobs.items() if self._refused.get(row_id, (0, now))[1] <= now]
        return due, {job.id: self._results[job.id] for job in due}

    def next_try_s(self) -> float | None:
        """Seconds until the earliest refused row's next try (0 if one is due); None if none."""
        if not self._refused:
            return None
        return max(min(at for _, at in self._refused.values()) - self._clock(), 0.0)

    def keep(self, jobs: Iterable[models.StagedJob], results: Mapping[int, models.PublishResult]) -> None:
        """Hold these jobs (those with a result: the others were not handed over) until settled."""
        for job in jobs:
            if job.id not in results:
                continue
            self._forget(job.id)
            kept, result = slim(job), _kept(results[job.id])
            self._jobs[job.id] = kept
            self._results[job.id] = result
            self._bytes += held_bytes(kept, result)

    def _forget(self, row_id: int) -> None:
        kept, result = self._jobs.pop(row_id, None), self._results.pop(row_id, None)
        if kept is not None and result is not None:
            self._bytes -= held_bytes(kept, result)

    def settled(
        self,
        taken: Iterable[models.StagedJob],
        deferred: Iterable[models.StagedJob],
        refused: Iterable[models.StagedJob],
        results: Mapping[int, models.PublishResult],
    ) -> list[models.StagedJob]:
        """A step committed the settlement of the ``taken`` jobs (those ``pending`` gave it) but
        ``deferred`` (held rows) and ``refused`` ones; return the refused ones held for the
        first time."""
        for job in taken:
            self._forget(job.id)
        self.keep(deferred, results)
        first = []
        now = self._clock()
        for job in refused:
            times = self._refused.get(job.id, (0, 0.0))[0] + 1
            self._refused[job.id] = (times, now + self._refused_backoff.delay(times))
            if times == 1:
                first.append(job)
        self.keep(refused, results)
        for row_id in self._refused.keys() - self._jobs.keys():
            del self._refused[row_id]  # written at last
        self.failing = self.over_cap = False
        self._retries.reset()
        self._next_at = 0.0
        return first

    def failed(self, jobs: Iterable[models.StagedJob], results: Mapping[int, models.PublishResult]) -> float:
        """Writing the settlement of ``jobs`` failed: keep them, back off; return the wait."""
        self.keep(jobs, results)
        self.failing, self.over_cap = True, False
        delay = self._retries.next()
        self._next_at = self._clock() + delay
        return delay

    def wait_s(self) -> float:
        """How long until the next attempt to write a failing settlement."""
        return max(self._next_at - self._clock(), 0.0)

    def crowded_out(self) -> float:
        """The process holds too many rows (``crowded``): count it as a failing settlement (the
        relay publishes nothing new, only tries the held rows again), back off; return the wait."""
        self.failing = self.over_cap = True
        delay = self._retries.next()
        self._next_at = self._clock() + delay
        return delay

    def clear(self) -> None:
        self._jobs.clear()
        self._results.clear()
        self._bytes = 0
        self._refused.clear()
        self.failing = self.over_cap = False
        self._retries.reset()
        self._next_at = 0.0

"""A lanes fault run seen from both sides: what the broker received, from whom, and who held
which lane's lock meanwhile (tests/faults/test_lanes_faults.py).

- :class:`SteadyKeyedLoad`: one producer staging keyed jobs at a steady rate; each job's args are
  its key and its number within the key.
- :class:`BrokerLog`: Redis ``MONITOR`` on the test's private server. Every drain process names
  its connection (``client_name`` in its backend URL: redis-py sends ``CLIENT SETNAME`` on
  connect, which MONITOR shows with the client's address), so each RQ script call (``EVALSHA``)
  has a sender. MONITOR lists commands in the order Redis runs them: the broker's receive order.
- :class:`LaneSampler`: ``pg_locks`` every few tens of milliseconds: each lane's lock holder, by
  the ``application_name`` of its session.
- :func:`tenures`, :func:`check_publishes`, :func:`takeovers`: the counts the test asserts.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
import redis
from psycopg.types.json import Jsonb

from drain.config import settings as config
from drain.store import migrations, reading, sql
from tests.support import faultload

# --- the lanes index -------------------------------------------------------------------------


def build_lanes_index(dsn: str, lanes: int) -> None:
    """What `drain migrate` with ``lanes`` adds to public.staged_jobs: the lanes index and its function."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrations.build_lanes_index(migrations.Autocommit(conn), sql.Names("public", "staged_jobs"), lanes)


def lane_reader(lanes: int, led: Sequence[int]) -> reading.Reader:
    """A Reader as a member leading ``led`` of ``lanes`` lanes, the lanes index serving, sets it."""
    reader = reading.Reader(config.BATCH_MAX_BYTES)
    reader.lane_count = lanes
    reader.other_lanes = "{" + ",".join(str(n) for n in range(lanes) if n not in led) + "}"
    reader.led_lanes = "{" + ",".join(map(str, led)) + "}"
    reader.led_count, reader.lanes_indexed = len(led), True
    return reader


# --- the producer ----------------------------------------------------------------------------


class SteadyKeyedLoad:
    """Stage ``rate`` keyed jobs a second into ``queue`` until :meth:`stop` (or for
    ``max_seconds``), on one connection: transactions of ``per_transaction`` jobs of distinct keys
    taken in turn, every ``rollback_every``-th rolled back. A key's jobs are staged in its number
    order, so row id order within a key is the order drain promises."""

    def __init__(
        self,
        dsn: str,
        queue: str,
        *,
        rate: float,
        keys: int,
        max_seconds: float,
        per_transaction: int = 10,
        rollback_every: int = 10,
    ) -> None:
        assert per_transaction <= keys, "a transaction's keys are distinct"
        self.dsn, self.queue = dsn, queue
        self.rate, self.max_seconds, self.per_transaction = rate, max_seconds, per_transaction
        self.rollback_every = rollback_every
        self.keys = [f"key-{n:02d}" for n in range(keys)]
        self.committed: dict[uuid.UUID, tuple[int, str]] = {}
        """job id -> (row id, key) of every committed job."""
        self.rolled_back: set[uuid.UUID] = set()
        self.errors: list[str] = []
        self._numbers = collections.Counter[str]()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-keyed-load", daemon=True)

    def start(self) -> SteadyKeyedLoad:
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stop staging (at the next transaction), without waiting."""
        self._stopping.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop staging, wait for the producer, and fail on any error it had."""
        self._stopping.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the producer did not finish"
        assert not self.errors, self.errors

    def _run(self) -> None:
        transactions = int(self.rate * self.max_seconds / self.per_transaction)
        started = time.monotonic()
        try:
            with psycopg.connect(self.dsn) as conn:
                for n in range(transactions):
                    due = started + n * self.per_transaction / self.rate
                    # the pace, not a wait for a state
                    if self._stopping.wait(max(0.0, due - time.monotonic())):
                        return
                    self._transaction(conn, n)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _transaction(self, conn: psycopg.Connection[Any], n: int) -> None:
        first = n * self.per_transaction
        keys = [self.keys[(first + i) % len(self.keys)] for i in range(self.per_transaction)]
        rows = []
        for key in keys:
            self._numbers[key] += 1
            row = conn.execute(
                "INSERT INTO staged_jobs (job_name, job_args, queue, ordering_key) "
                "VALUES (%s, %s, %s, %s) RETURNING job_id, id",
                (faultload.JOB_NAME, Jsonb([key, self._numbers[key]]), self.queue, key),
            ).fetchone()
            assert row is not None
            rows.append((row[0], (int(row[1]), key)))
        if n % self.rollback_every == self.rollback_every - 1:
            conn.rollback()
            self.rolled_back.update(job_id for job_id, _ in rows)
        else:
            conn.commit()
            self.committed.update(rows)


# --- the broker's side -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Publish:
    """One RQ script call as Redis ran it."""

    order: int
    """Its place in the broker's stream."""
    at: float
    """The broker's clock (epoch seconds)."""
    sender: str
    """The client name its connection set ("?" if it set none)."""
    job_ids: tuple[uuid.UUID, ...]


_LINE = re.compile(r'^(\d+\.\d+) \[\d+ ([^\]]*)\] "([^"]*)"(?: "([^"]*)")?(?: "([^"]*)")?')
_JOB_KEY = re.compile(r'"rq:job:([0-9a-f-]{36})"')


class BrokerLog:
    """Every RQ script call on a private Redis server, with its sender (see the module
    docstring). MONITOR is on before :meth:`start` returns."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=30)
        self._monitor = self._client.monitor()
        self._monitor.connection.send_command("MONITOR")
        reply = self._monitor.connection.read_response()
        assert reply in (b"OK", "OK"), reply
        self.publishes: list[Publish] = []
        self.names: dict[str, str] = {}
        """Client address -> the name it set last."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._read, name="broker-log", daemon=True)
        self._url = url

    def start(self) -> BrokerLog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with redis.Redis.from_url(self._url) as poke:
            poke.ping()  # a command MONITOR shows: the reader wakes and sees it should stop
        self._thread.join(30)
        assert not self._thread.is_alive(), "the MONITOR reader did not stop"
        self._monitor.connection.disconnect()
        self._client.close()

    def _read(self) -> None:
        while not self._stopping.is_set():
            line = self._monitor.connection.read_response()
            self._parse(line.decode() if isinstance(line, bytes) else str(line))

    def _parse(self, line: str) -> None:
        found = _LINE.match(line)
        if found is None:
            return
        at, client, command, first, second = found.groups()
        command = command.upper()
        if command == "CLIENT" and (first or "").upper() == "SETNAME" and second is not None:
            self.names[client] = second
        elif command in ("EVALSHA", "EVAL"):
            job_ids = tuple(uuid.UUID(text) for text in dict.fromkeys(_JOB_KEY.findall(line)))
            if job_ids:
                sender = self.names.get(client, "?")
                self.publishes.append(Publish(len(self.publishes), float(at), sender, job_ids))


# --- the database's side ---------------------------------------------------------------------

Sample = tuple[float, dict[int, str]]
"""When (epoch seconds), and each held lane's holder (its session's application_name)."""

HOLDERS_SQL = """
SELECT l.objid::int, a.application_name
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
  AND l.classid = %s AND l.objsubid = 2 AND l.objid < %s
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


class LaneSampler:
    """Who holds each lane's lock (``drain.relay.lanes``: two-int advisory locks, the lane key
    space then the lane), every ``every_s``, in a thread."""

    def __init__(self, dsn: str, space: int, lanes: int, every_s: float = 0.05) -> None:
        self.dsn, self.space, self.lanes, self.every_s = dsn, space, lanes, every_s
        self.samples: list[Sample] = []
        self.first_held: dict[str, float] = {}
        """Each drain's first sample holding a lane."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lane-sampler", daemon=True)

    def start(self) -> LaneSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(30)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stopping.wait(self.every_s):
                before = time.time()
                rows = conn.execute(HOLDERS_SQL, (self.space, self.lanes)).fetchall()
                at = (before + time.time()) / 2
                for _, name in rows:
                    self.first_held.setdefault(name, at)
                self.samples.append((at, {int(lane): name for lane, name in rows}))


def lanes_of_keys(dsn: str, keys: Sequence[str], lane_count: int) -> dict[str, int]:
    """Each key's lane, as the server computes it (queries.sql ``in_lanes``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT k, mod(hashtext(k) & 2147483647, %s) FROM unnest(%s::text[]) AS k",
            (lane_count, list(keys)),
        ).fetchall()
    return {key: int(lane) for key, lane in rows}


# --- the counts ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tenure:
    """A run of samples in which one drain held one lane; it began after ``after`` and ended
    before ``before`` (the samples on either side)."""

    holder: str
    after: float
    before: float


def tenures(samples: Sequence[Sample], lanes: int) -> dict[int, list[Tenure]]:
    """Each lane's tenures, in time order (a lane held by nobody has none then)."""
    result: dict[int, list[Tenure]] = {lane: [] for lane in range(lanes)}
    for lane in range(lanes):
        holder: str | None = None
        after = float("-inf")
        previous = float("-inf")
        for at, held in samples:
            now = held.get(lane)
            if now != holder:
                if holder is not None:
                    result[lane].append(Tenure(holder, after, at))
                holder, after = now, previous
            previous = at
        if holder is not None:
            result[lane].append(Tenure(holder, after, float("inf")))
    return result


@dataclasses.dataclass
class LaneReport:
    publishes: int = 0
    """(script call, lane) pairs: a call carries the rows of every lane its drain leads."""
    outside: list[str] = dataclasses.field(default_factory=list)
    """Calls carrying a lane's rows while another drain held that lane's lock: the samples on
    both sides of the call show that drain."""
    unsampled: list[str] = dataclasses.field(default_factory=list)
    """Calls in no sampled tenure of their sender, and not outside either: a tenure shorter than
    the gap between two samples (the sampler is a thread of the test, and shares its cores)."""
    overlaps: list[str] = dataclasses.field(default_factory=list)
    """Calls of an earlier tenure of a lane that reached the broker after one of a later tenure."""
    widest_gap_s: float = 0.0
    """The longest time between two samples."""

    def __str__(self) -> str:
        return (
            f"{self.publishes} lane publishes, {len(self.outside)} while another drain led the lane, "
            f"{len(self.overlaps)} overlapping, {len(self.unsampled)} in a tenure too short to sample "
            f"(the widest gap between samples {self.widest_gap_s:.2f} s)"
        )


def check_publishes(
    publishes: Iterable[Publish], lane_of_job: Mapping[uuid.UUID, int], samples: Sequence[Sample], lanes: int
) -> LaneReport:
    """Place each call's rows of each lane in a tenure (:func:`tenures`) of its sender on that
    lane; count those made while another drain held the lane, and those that reached the broker
    after a call of a later tenure of the lane."""
    held = tenures(samples, lanes)
    times = [at for at, _ in samples]
    report = LaneReport(widest_gap_s=max((b - a for a, b in itertools.pairwise(times)), default=0.0))
    latest: dict[int, tuple[int, Publish]] = {}
    for publish in publishes:
        for lane in sorted({lane_of_job[job_id] for job_id in publish.job_ids if job_id in lane_of_job}):
            report.publishes += 1
            index = next(
                (
                    n
                    for n, tenure in enumerate(held[lane])
                    if tenure.holder == publish.sender and tenure.after <= publish.at <= tenure.before
                ),
                None,
            )
            if index is None:
                place = bisect.bisect(times, publish.at)
                around = {samples[n][1].get(lane) for n in (place - 1, place) if 0 <= n < len(samples)}
                said = f"lane {lane}: {publish.sender}'s call {publish.order} at {publish.at:.3f}"
                if len(around) == 1 and None not in around:
                    report.outside.append(f"{said}, while {around.pop()} led it")
                else:
                    report.unsampled.append(said)
                continue
            before = latest.get(lane)
            if before is not None and before[0] > index:
                report.overlaps.append(
                    f"lane {lane}: {publish.sender}'s call {publish.order} after {before[1].sender}'s "
                    f"call {before[1].order} of a later tenure"
                )
            else:
                latest[lane] = (index, publish)
    return report


def takeovers(samples: Sequence[Sample], kills: Iterable[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """For each drain killed (its name, when), each lane it held just before: how long until
    another drain held it (inf: never)."""
    result = []
    for name, at in kills:
        before = [held for when, held in samples if when < at]
        lanes = sorted(lane for lane, holder in (before[-1] if before else {}).items() if holder == name)
        for lane in lanes:
            taken = next(
                (when for when, held in samples if when > at and held.get(lane) not in (None, name)),
                float("inf"),
            )
            result.append((name, lane, taken - at))
    return result

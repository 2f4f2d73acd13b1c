"""Per-key order end to end (issue 25): producers that stage keyed jobs as an app that serializes
on its entity does, what a single consumer per queue saw, and the check.

- :class:`KeyedLoad`: ``threads`` producers, each transaction staging 1-4 jobs of random keys
  after locking those keys (``pg_advisory_xact_lock``, in one order: no deadlock), so a key's next
  job is staged only after its previous one committed: staging order = row id order within a key,
  the order drain promises. The jobs are INSERTed as an app writing SQL does (the staged-jobs
  table's ``ordering_key`` column). Each transaction also writes its jobs' ``ledger`` rows (for
  ``ledger.tally``) and their row ids and keys (``keyed_ledger``); some roll back.
- The consumers record each delivery in arrival order with the key they were handed: an RQ job
  (:func:`record`, run by a real ``rq worker``) from ``job.meta``, an AMQP message
  (:class:`KeyedConsumer`, pika) from its ``x-ordering-key`` header.
- :func:`check_order`: per key, the order of first deliveries is the row id order; duplicates
  (a crash between the broker's acknowledgement and the commit) are counted, not failures.
- :class:`DrainUnderKills`: a real ``drain run`` SIGKILLed whenever the consumer has seen enough
  more jobs since its start, and started again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import random
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pika
import psycopg
import rq
from psycopg.types.json import Jsonb

from drain import models
from drain.relay import failpoints
from tests.support import processes, tasks
from tests.support.waiting import wait_until

KEYS = tuple(f"entity-{n:02d}" for n in range(50))
JOB_NAME = "tests.support.ordering.record"
REFUSE_EVERY = 5
FAILPOINT = f"refuse_first=every:{REFUSE_EVERY}"
"""Every fifth row (by id) is refused once: 20% of the rows, the same ones after any restart."""
LOCK_SPACE = 25  # pg_advisory_xact_lock(LOCK_SPACE, key index): the producers' entity locks

SCHEMA = """
CREATE TABLE IF NOT EXISTS keyed_ledger (
    job_id       uuid PRIMARY KEY,
    row_id       bigint NOT NULL,
    ordering_key text
);
CREATE TABLE IF NOT EXISTS keyed_deliveries (
    seq          bigserial PRIMARY KEY,
    job_id       uuid NOT NULL,
    ordering_key text
);
"""

Delivery = tuple[uuid.UUID, str | None]
"""A job id as a consumer received it, with the ordering key it was handed (None: none)."""


def install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


# --- the producers ---------------------------------------------------------------------------


@dataclasses.dataclass
class KeyedResult:
    committed: dict[uuid.UUID, tuple[int, str | None]] = dataclasses.field(default_factory=dict)
    """job id -> (row id, ordering key) of every committed job."""
    rolled_back: set[uuid.UUID] = dataclasses.field(default_factory=set)
    errors: list[str] = dataclasses.field(default_factory=list)


class KeyedLoad:
    """Stage ``jobs`` jobs named ``job`` into ``queue`` from ``threads`` producers (see the module
    docstring); ``unkeyed_fraction`` of them without a key. ``start``/``join`` run it in threads."""

    def __init__(
        self,
        dsn: str,
        jobs: int,
        *,
        queue: str,
        backend: str = "default",
        threads: int = 4,
        keys: Sequence[str] = KEYS,
        unkeyed_fraction: float = 0.0,
        rollback_fraction: float = 0.1,
        pace_s: tuple[float, float] = (0.0, 0.01),
        seed: int | None = None,
        job: str = JOB_NAME,
    ) -> None:
        self.job = job
        self.dsn, self.queue, self.backend, self.keys = dsn, queue, backend, list(keys)
        self.unkeyed_fraction, self.rollback_fraction, self.pace_s = (
            unkeyed_fraction,
            rollback_fraction,
            pace_s,
        )
        self.result = KeyedResult()
        self._left = jobs
        self._lock = threading.Lock()
        self._seed = random.randrange(1 << 30) if seed is None else seed
        self._threads = [
            threading.Thread(target=self._work, args=(n,), name=f"keyed-stager-{n}", daemon=True)
            for n in range(threads)
        ]

    def start(self) -> KeyedLoad:
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout_s: float = 300.0) -> KeyedResult:
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a staging thread did not finish"
        assert not self.result.errors, self.result.errors[:3]
        return self.result

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def _take(self, wanted: int) -> int:
        with self._lock:
            granted = min(wanted, self._left)
            self._left -= granted
            return granted

    def _work(self, index: int) -> None:
        rng = random.Random(self._seed + index)
        try:
            with psycopg.connect(self.dsn) as conn:
                while count := self._take(rng.randint(1, 4)):
                    self._transaction(conn, rng, count)
                    threading.Event().wait(rng.uniform(*self.pace_s))
        except Exception as exc:
            with self._lock:
                self.result.errors.append(f"{type(exc).__name__}: {exc}")

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random, count: int) -> None:
        keys: list[str | None] = [
            None if rng.random() < self.unkeyed_fraction else rng.choice(self.keys) for _ in range(count)
        ]
        for index in sorted({self.keys.index(key) for key in keys if key is not None}):
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_SPACE, index))
        txn = uuid.uuid4().hex
        rows = [self._insert(conn, [txn, n], key) for n, key in enumerate(keys)]
        ids = [row[0] for row in rows]
        conn.execute(
            "INSERT INTO keyed_ledger (job_id, row_id, ordering_key) "
            "SELECT * FROM unnest(%s::uuid[], %s::bigint[], %s::text[])",
            (ids, [row[1] for row in rows], [row[2] for row in rows]),
        )
        conn.execute(
            "INSERT INTO ledger (job_id, txn, backend) SELECT unnest(%s::uuid[]), %s, %s",
            (ids, txn, self.backend),
        )
        if rng.random() < self.rollback_fraction:
            conn.rollback()
            with self._lock:
                self.result.rolled_back.update(ids)
            return
        conn.commit()
        with self._lock:
            self.result.committed.update((row[0], (row[1], row[2])) for row in rows)

    def _insert(
        self, conn: psycopg.Connection[Any], args: list[Any], key: str | None
    ) -> tuple[uuid.UUID, int, str | None]:
        row = conn.execute(
            "INSERT INTO staged_jobs (job_name, job_args, queue, backend, ordering_key) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING job_id, id, ordering_key",
            (self.job, Jsonb(args), self.queue, self.backend, key),
        ).fetchone()
        assert row is not None
        return row[0], row[1], row[2]


# --- the consumers ---------------------------------------------------------------------------

_sessions: dict[str, psycopg.Connection[Any]] = {}


def record(*_args: Any, **_kwargs: Any) -> str:
    """The RQ task: record this delivery with the ordering key the job's meta carries."""
    job = rq.get_current_job()
    assert job is not None
    conn = _sessions.get("deliveries")
    if conn is None or conn.closed:
        conn = _sessions["deliveries"] = psycopg.connect(os.environ[tasks.DSN_VARIABLE], autocommit=True)
    conn.execute(
        "INSERT INTO keyed_deliveries (job_id, ordering_key) VALUES (%s, %s)",
        (job.id, job.meta.get(models.ORDERING_KEY_META)),
    )
    return job.id


def recorded(dsn: str) -> list[Delivery]:
    """What the worker ran (RQ's :func:`record`, or Celery's ``tests.celery.keyed``), in the
    order it ran it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            (row[0], row[1])
            for row in conn.execute("SELECT job_id, ordering_key FROM keyed_deliveries ORDER BY seq")
        ]


class KeyedConsumer:
    """One pika consumer per queue (one channel: manual acks after recording, prefetch
    ``prefetch``), on its own thread; ``deliveries`` in arrival order, per queue."""

    def __init__(self, url: str, queues: Sequence[str], prefetch: int = 50) -> None:
        self.url, self.queues, self.prefetch = url, tuple(queues), prefetch
        self.deliveries: dict[str, list[Delivery]] = {queue: [] for queue in self.queues}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyed-consumer", daemon=True)

    def __enter__(self) -> KeyedConsumer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def received(self) -> dict[str, list[Delivery]]:
        """A copy of what each queue delivered so far."""
        return {queue: list(seen) for queue, seen in self.deliveries.items()}

    def count(self) -> int:
        assert self.error is None, self.error
        return sum(len(seen) for seen in self.deliveries.values())

    def _run(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self.url))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            for queue in self.queues:
                channel.basic_consume(queue, self._handler(queue))
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.2)
            connection.close()
        except BaseException as exc:
            self.error = exc

    def _handler(self, queue: str) -> Callable[..., None]:
        def on_message(channel: Any, method: Any, properties: Any, _body: bytes) -> None:
            key = (properties.headers or {}).get(models.ORDERING_KEY_HEADER)
            self.deliveries[queue].append((uuid.UUID(properties.message_id), key))
            channel.basic_ack(method.delivery_tag)

        return on_message


# --- the check -------------------------------------------------------------------------------


@dataclasses.dataclass
class OrderReport:
    keys: int
    first_deliveries: int
    duplicates: int
    out_of_order: list[str]
    """Per key whose first deliveries are not in row id order: the key and the two jobs."""
    wrong_key: list[str]
    """Deliveries whose key (meta or header) is not the one the job was staged with."""
    split_keys: list[str] = dataclasses.field(default_factory=list)
    """Keys whose jobs reached more than one queue."""
    late_copies: list[str] = dataclasses.field(default_factory=list)
    """Copies of a job delivered after a later job of its key: a crash republishes a job still
    in the table, and the next of its key waits for its deletion, so every copy comes first."""

    def __str__(self) -> str:
        return (
            f"{self.keys} keys, {self.first_deliveries} first deliveries, {self.duplicates} duplicates, "
            f"{len(self.out_of_order)} keys out of order, {len(self.late_copies)} late copies, "
            f"{len(self.wrong_key)} wrong keys"
        )

    def check(self) -> None:
        assert not self.out_of_order, f"per-key order broken: {self.out_of_order[:5]} ({self})"
        assert not self.wrong_key, f"the consumer was handed the wrong key: {self.wrong_key[:5]}"
        assert not self.split_keys, f"a key's jobs reached several queues: {self.split_keys[:5]}"
        assert not self.late_copies, f"a copy came after a later job of its key: {self.late_copies[:5]}"


def check_order(
    staged: Mapping[uuid.UUID, tuple[int, str | None]], queues: Mapping[str, Sequence[Delivery]]
) -> OrderReport:
    """``staged``: job id -> (row id, key); ``queues``: what each queue's consumer received, in
    order. Jobs that were never staged (or rolled back) are ignored here: ``ledger.tally`` counts
    them as phantom."""
    seen: set[uuid.UUID] = set()
    latest: dict[str, int] = {}
    queues_of: dict[str, set[str]] = collections.defaultdict(set)
    out_of_order: dict[str, str] = {}
    duplicates, wrong, late = 0, [], []
    for queue, deliveries in queues.items():
        for job_id, handed in deliveries:
            if job_id not in staged:
                continue
            row_id, key = staged[job_id]
            if handed != key:
                wrong.append(f"{job_id}: staged with {key!r}, handed {handed!r}")
            first = job_id not in seen
            seen.add(job_id)
            duplicates += not first
            if key is None:
                continue
            queues_of[key].add(queue)
            before = latest.setdefault(key, row_id)
            if row_id < before and first:
                out_of_order.setdefault(key, f"{key}: row {row_id} ({job_id}) came after row {before}")
            elif row_id < before:
                late.append(f"{key}: a copy of row {row_id} ({job_id}) came after row {before}")
            latest[key] = max(row_id, before)
    split = [f"{key}: {sorted(names)}" for key, names in queues_of.items() if len(names) > 1]
    return OrderReport(len(queues_of), len(seen), duplicates, list(out_of_order.values()), wrong, split, late)


def refused_rows(logs: Iterable[Path]) -> set[int]:
    """The row ids the ``refuse_first`` failpoint refused, from the drains' logs."""
    pattern = re.compile(re.escape(failpoints.REFUSED).replace(re.escape("{}"), r"(\d+)"))
    return {int(found) for log in logs for found in pattern.findall(log.read_text(errors="replace"))}


# --- the drain, killed and started again -----------------------------------------------------


class DrainUnderKills:
    """``drain run`` with the ``refuse_first`` failpoint, SIGKILLed each time ``progress()`` (the
    consumer's count) has grown by ``every`` since it started, ``kills`` times, and started
    again at once; the last one runs until :meth:`stop`."""

    def __init__(
        self, config: Path, tmp: Path, progress: Callable[[], int], *, kills: int, every: int
    ) -> None:
        self.config, self.tmp, self.progress = config, tmp, progress
        self.kills, self.every = kills, every
        self.logs: list[Path] = []
        self.killed = 0
        self._current: processes.Process | None = None

    def _start(self) -> processes.Process:
        log = self.tmp / f"drain-{len(self.logs)}.log"
        self.logs.append(log)
        self._current = processes.start_drain(self.config, None, log, failpoints=FAILPOINT)
        return self._current

    def run_kills(self, timeout_s: float = 120.0) -> None:
        """Start the drain, then kill and restart it ``kills`` times on the consumer's progress."""
        drain_process = self._start()
        for _ in range(self.kills):
            start = self.progress()

            def moved(drain_process: processes.Process = drain_process, start: int = start) -> bool:
                assert drain_process.alive(), drain_process.output()[-3000:]
                return self.progress() >= start + self.every

            wait_until(f"the consumer to see {self.every} more jobs", moved, timeout_s)
            drain_process.kill()
            self.killed += 1
            drain_process = self._start()

    def stop(self) -> None:
        if self._current is not None:
            with contextlib.suppress(Exception):
                self._current.stop()

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in self.logs)


def counted(*queues: Iterable[Delivery]) -> collections.Counter[uuid.UUID]:
    """How many times each job id was delivered, over every queue given."""
    return collections.Counter(job_id for job_id, _key in itertools.chain(*queues))

"""Schema versions: create a table at the current version, or upgrade an older one in place.

Versions
--------
- A table records its versions in ``<table>_versions``. Without one it is version 1 (drain 0.1.0).
- Every run first replaces the check function (``checks.sql``) the table's constraint calls.
- A fresh install runs ``schema.sql``, the current schema, at once.
- An older table runs the upgrades after its version (UPGRADES), recording each, while
  producers stage and a drain forwards.
- Every run then replaces the code objects (``functions.sql``) and validates the constraints.

Blocks
------
An upgrade (``upgrade_NNNN.sql``) is a list of blocks. A block's name says how it runs.

- ``lock_*``: one transaction under ``lock_timeout`` (LOCK_TIMEOUT_MS), retried with backoff.
  While a catalog change waits for its lock, every producer's INSERT queues behind it.
- ``rows_*``: one transaction changing rows, locking only them. ``rows_bury_*`` moves rows to
  the dead letters (Report.buried).
- ``concurrently_*``: one statement outside a transaction (``CREATE INDEX CONCURRENTLY``). The
  rest of the name is the index's; an invalid one an earlier attempt left is dropped first.

Constraints
-----------
A constraint is added ``NOT VALID`` (a brief lock), and the rows that break it are buried. A
NOT VALID constraint still checks every row an UPDATE writes: the drain's UPDATE of such a row
would fail its whole batch. Every run ends by validating the ``drain_*`` constraints still NOT
VALID (SHARE UPDATE EXCLUSIVE: it blocks neither producers nor the drain).

Adding version N
----------------
Every block is idempotent: the next run finishes one cut short. Write ``upgrade_000N.sql`` and
the same change in schema.sql (a test checks both paths end in the same catalog). Append
``N: description`` to UPGRADES, and add a Django migration that calls :func:`upgrade`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import psycopg
from psycopg import sql as pgsql

from drain import errors, version
from drain import names as db_names
from drain.store import sql

log = logging.getLogger(__name__)

LOCK_TIMEOUT_MS = 100  # the longest a producer's INSERT waits behind one of our catalog changes
LOCK_ATTEMPTS = 60  # then give up, saying which transactions to look at
LOCK_RETRY_BASE_S = 0.1
LOCK_RETRY_MAX_S = 2.0
MIGRATE_LOCK_RETRY_S = 0.1  # while another migration runs (migrations.sql lock)
LOCK_NOT_AVAILABLE = "55P03"
DEADLOCK_DETECTED = "40P01"
FIRST_VERSION = 1  # drain 0.1.0's schema, which recorded no version
MAX_WAKE_SLOTS = 8  # idle members of a table with lanes that sleep notified (drain.relay.wakeup)
MIGRATIONS_FILE = "migrations.sql"
BURY_PREFIX = "rows_bury_"  # a rows block that moves rows to the dead letters: counted

Kind = Literal["lock", "rows", "concurrently"]
KINDS: tuple[Kind, ...] = ("lock", "rows", "concurrently")


UPGRADES = {
    2: "dead letters numbered on their own; the table refuses what no backend can carry",
    3: "an ordering key on each row",
}
"""Each schema version after the first, reached from the one before by ``upgrade_NNNN.sql``."""
LATEST_VERSION = max(UPGRADES)
KEYS_VERSION = 3
"""The version that gave rows and dead letters their ordering key (`drain status`, `drain dead`)."""


@dataclasses.dataclass(frozen=True)
class SqlBlock:
    """One block of an upgrade. ``index``: a ``concurrently`` block's index (its placeholder)."""

    kind: Kind
    name: str
    statement: pgsql.Composed
    index: str | None = None


@dataclasses.dataclass
class Report:
    """What one :func:`upgrade` did."""

    before: int
    after: int
    buried: int = 0
    """Rows moved to the dead letters because they break a constraint of the table."""
    not_valid: list[str] = dataclasses.field(default_factory=list)
    """Constraints that stay NOT VALID: rows still break them."""


class Runner(Protocol):
    """A database session the migration drives, in autocommit mode between transactions."""

    def transaction(self) -> contextlib.AbstractContextManager[Any]: ...

    def execute(self, statement: pgsql.Composed) -> int:
        """Run one statement; return the rows it changed (its row count)."""
        ...

    def fetch(self, statement: pgsql.Composed) -> list[tuple[Any, ...]]: ...


def statement(name: str, names: sql.Names, **values: Any) -> pgsql.Composed:
    """A block of migrations.sql with the table's names and ``values`` (as literals) filled in."""
    filled: dict[str, pgsql.Composable] = {key: pgsql.Literal(value) for key, value in values.items()}
    if "index" in values:
        filled["qualified_index"] = pgsql.Literal(names.qualify(values["index"]))
        filled["index"] = pgsql.Identifier(values["index"])
    text = sql.raw_queries(MIGRATIONS_FILE)[name]
    return pgsql.SQL(text).format(**names.identifiers(), **names.literals(), **filled)


def blocks(version: int, names: sql.Names) -> list[SqlBlock]:
    """The blocks of the upgrade to ``version`` in file order, filled in for this table."""
    found = []
    kinds = {each: each for each in KINDS}
    filename = f"upgrade_{version:04d}.sql"
    for name in sql.raw_queries(filename):
        prefix, _, rest = name.partition("_")
        if prefix not in kinds:
            raise ValueError(f"{filename}: block {name} has no kind ({', '.join(KINDS)})")
        kind = kinds[prefix]
        index = rest if kind == "concurrently" else None
        found.append(SqlBlock(kind, name, sql.template(filename, names, name), index))
    return found


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error from psycopg, psycopg2 or Django (which wraps them)."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        if isinstance(code, str):
            return code
        seen = seen.__cause__
    return None


def current_version(runner: Runner, names: sql.Names) -> int:
    """The table's schema version: 0 when it does not exist, 1 when it predates the versions table."""
    ((has_table, has_dead, has_versions),) = runner.fetch(statement("state", names))
    if has_versions:
        ((recorded,),) = runner.fetch(statement("version", names))
        if recorded is not None:
            return int(recorded)
    return FIRST_VERSION if has_table or has_dead else 0


def _record(names: sql.Names, number: int, description: str) -> pgsql.Composed:
    return statement(
        "record_version", names, version=number, description=description, drain_version=version.__version__
    )


def _locked(
    runner: Runner,
    names: sql.Names,
    statements: Sequence[pgsql.Composed],
    what: str,
    sleep: Callable[[float], None],
) -> None:
    """Run ``statements`` in one transaction under the lock timeout, again after a timeout."""
    timeout = statement("lock_timeout", names, lock_timeout=f"{LOCK_TIMEOUT_MS}ms")
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with runner.transaction():
                runner.execute(timeout)
                for each in statements:
                    runner.execute(each)
            return
        except Exception as exc:
            if sqlstate(exc) not in (LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED):
                raise
            if attempt == LOCK_ATTEMPTS:
                raise errors.SchemaError(
                    f"drain migrate: {what}: no lock on {names.qualified} in {LOCK_ATTEMPTS} "
                    f"tries of {LOCK_TIMEOUT_MS} ms; long transactions hold it (pg_stat_activity); "
                    "what is done stays done: run `drain migrate` again"
                ) from None
            log.info(
                "waiting for a brief lock on %s (%s)",
                names.qualified,
                what,
                extra={"event": "migrate_lock_wait", "attempts": attempt},
            )
            sleep(min(LOCK_RETRY_BASE_S * 2.0 ** min(attempt - 1, 10), LOCK_RETRY_MAX_S))


def _run_block(runner: Runner, names: sql.Names, block: SqlBlock, sleep: Callable[[float], None]) -> int:
    """Run one block of an upgrade as its kind says; return the rows it buried."""
    if block.kind == "lock":
        _locked(runner, names, [block.statement], block.name, sleep)
    elif block.kind == "rows":
        with runner.transaction():
            changed = runner.execute(block.statement)
        if block.name.startswith(BURY_PREFIX):
            return max(changed, 0)
    else:
        index = names.derived()[str(block.index)]
        ((invalid,),) = runner.fetch(statement("index_invalid", names, index=index))
        if invalid:
            runner.execute(statement("drop_index", names, index=index))
        runner.execute(block.statement)
    return 0


def upgrade(
    runner: Runner,
    names: sql.Names,
    *,
    sleep: Callable[[float], None] = time.sleep,
    repair: bool = True,
    wake_slots: int = 1,
    lanes: int = 1,
    poll_lock: bool = True,
) -> Report:
    """Bring the table to LATEST_VERSION, whatever its version, and report what it did.

    - ``repair``: after the upgrades (or on a current table), run schema.sql again. It creates
      what is missing (a dropped index) and changes nothing else. Tests turn it off.
    - ``wake_slots``: at least this many wake slots in the wake-up triggers (:func:`wake_slots`).
    - ``lanes``: more than one, the lanes index and function for that count are built last
      (:func:`build_lanes_index`).
    - ``poll_lock``: try the migrate lock every MIGRATE_LOCK_RETRY_S (a runner between
      transactions, ``drain migrate``); False: wait for it in one statement (a runner inside a
      transaction, Django's: polling there would wait forever beside a CREATE INDEX CONCURRENTLY,
      which waits for that transaction, where a wait in one statement is a deadlock PostgreSQL
      breaks).
    - SchemaError: the table is newer than this drain (nothing is changed), or a lock stays out
      of reach.
    """
    _take_migrate_lock(runner, names, sleep, poll=poll_lock)
    try:
        before = current_version(runner, names)
        if before > LATEST_VERSION:
            raise errors.SchemaError(
                f"{names.qualified} is at schema version {before}, newer than this drain's "
                f"{LATEST_VERSION}: nothing done; upgrade drain"
            )
        report = Report(before, LATEST_VERSION)
        check = [statement("versions_table", names), sql.checks(names)]
        _locked(runner, names, check, "the check function", sleep)
        if before == 0:
            created = _record(names, LATEST_VERSION, f"created at version {LATEST_VERSION}")
            _locked(runner, names, [sql.schema(names), created], "create", sleep)
        for number, description in UPGRADES.items() if before else ():
            if number > before:
                for block in blocks(number, names):
                    report.buried += _run_block(runner, names, block, sleep)
                with runner.transaction():
                    runner.execute(_record(names, number, description))
                log.info(
                    "%s: schema version %d (%s)",
                    names.qualified,
                    number,
                    description,
                    extra={"event": "migrated", "version": number},
                )
        if before and repair:
            _locked(runner, names, [sql.schema(names)], "the schema", sleep)
        _locked(runner, names, [sql.functions(names, wake_slots)], "functions", sleep)
        with runner.transaction():
            runner.execute(statement("validate", names))
            ((not_valid,),) = runner.fetch(statement("validate_result", names))
        report.not_valid = [name for name in str(not_valid).split(",") if name]
        build_lanes_index(runner, names, lanes)
    except BaseException:
        with contextlib.suppress(psycopg.Error):  # the session may be gone: say why it failed
            runner.fetch(statement("unlock", names))
        raise
    runner.fetch(statement("unlock", names))
    return report


def _take_migrate_lock(
    runner: Runner, names: sql.Names, sleep: Callable[[float], None], *, poll: bool
) -> None:
    """One migration at a time (migrations.sql lock, wait_lock): see :func:`upgrade`'s ``poll_lock``."""
    if not poll:
        runner.fetch(statement("wait_lock", names))
        return
    while not runner.fetch(statement("lock", names))[0][0]:
        sleep(MIGRATE_LOCK_RETRY_S)


def lanes_statement(name: str, names: sql.Names, lanes: int) -> pgsql.Composed:
    """A lanes block of migrations.sql (lanes_index, lanes_function and its body, lanes_ready,
    lanes_plan) for ``lanes`` lanes: the index's and function's names, queries.sql lane_of with
    the count as a constant, and the function's body as a string literal."""
    index = db_names.lanes_index(names.table, lanes)
    function = db_names.lanes_function(names.table, lanes)
    values: dict[str, pgsql.Composable] = {
        "index": pgsql.Identifier(index),
        "qualified_index": pgsql.Literal(names.qualify(index)),
        "function": pgsql.Identifier(function),
        "qualified_function": pgsql.Literal(names.qualify(function)),
        "lane_of": sql.lane_of(lanes),
        "not_parked_in_place": sql.query("not_parked_in_place", names),
    }
    if name == "lanes_function":
        values["body"] = pgsql.Literal(lanes_function_source(names, lanes)[0])
    return pgsql.SQL(sql.raw_queries(MIGRATIONS_FILE)[name]).format(**names.identifiers(), **values)


def lanes_function_source(names: sql.Names, lanes: int) -> tuple[str, list[str]]:
    """What ``lanes_function`` creates for ``lanes`` lanes, as the catalog keeps it: the body
    (pg_proc.prosrc) and the settings (proconfig). Store.lanes_index_problem compares them."""
    body = lanes_statement("lanes_function_body", names, lanes).as_string(None)
    settings = re.findall(r"SET (\w+ = \w+)", sql.raw_queries(MIGRATIONS_FILE)["lanes_function"])
    return body, [setting.replace(" = ", "=") for setting in settings]


def build_lanes_index(runner: Runner, names: sql.Names, lanes: int) -> None:
    """For more than one lane: build the lanes index for ``lanes`` lanes (CONCURRENTLY, outside a
    transaction; an invalid one an earlier attempt left is dropped first), then (re)create its
    function. Those of other counts stay (drains of another count may still run): DROP INDEX
    CONCURRENTLY and DROP FUNCTION the ones no drain uses."""
    if lanes <= 1:
        return
    index = db_names.lanes_index(names.table, lanes)
    ((invalid,),) = runner.fetch(statement("index_invalid", names, index=index))
    if invalid:
        runner.execute(statement("drop_index", names, index=index))
    runner.execute(lanes_statement("lanes_index", names, lanes))
    with runner.transaction():
        runner.execute(lanes_statement("lanes_function", names, lanes))


def wake_slots(lanes: int) -> int:
    """How many idle members of a table with ``lanes`` lanes can sleep until a commit wakes them
    (drain.relay.wakeup): one each, up to MAX_WAKE_SLOTS; more members poll. Each producer's
    INSERT statement probes every slot, so a table without lanes keeps one."""
    return max(1, min(lanes, MAX_WAKE_SLOTS))


def script(names: sql.Names, from_version: int | None = None, *, wake_slots: int = 1, lanes: int = 1) -> str:
    """The SQL of :func:`upgrade` for one's own migration tool (``drain migrate --print``): a
    fresh install (``from_version`` None) or the upgrade of a table at ``from_version``.

    Transactions are spelled out: a ``lock_timeout`` error runs that one again. Every statement
    is idempotent, and a guard refuses the wrong starting point.
    """
    timeout = statement("lock_timeout", names, lock_timeout=f"{LOCK_TIMEOUT_MS}ms")
    parts: list[str] = []

    def text(composed: pgsql.Composed) -> str:
        return composed.as_string(None).strip()

    def transaction(*statements: pgsql.Composed, locked: bool = True) -> None:
        body = [text(timeout)] if locked else []
        parts.append("\n".join(["BEGIN;", *body, *(text(each) for each in statements), "COMMIT;"]))

    head = f"-- drain {version.__version__}: {names.qualified}, schema version {LATEST_VERSION}"
    if from_version is None:
        parts.append(f"{head}, a fresh install.")
        transaction(
            statement("fresh_guard", names, version=LATEST_VERSION),
            statement("versions_table", names),
            sql.checks(names),
            sql.schema(names),
            _record(names, LATEST_VERSION, f"created at version {LATEST_VERSION}"),
        )
    else:
        if not FIRST_VERSION <= from_version <= LATEST_VERSION:
            raise errors.ConfigError(
                f"--from: schema versions run from {FIRST_VERSION} to {LATEST_VERSION}, not {from_version}"
            )
        parts.append(
            f"{head}, upgraded from version {from_version}. A lock_timeout error: run that "
            "transaction again (while it waits for its lock, INSERTs queue behind it)."
        )
        parts.append(text(statement("upgrade_guard", names)))
        transaction(statement("versions_table", names), sql.checks(names))
        for number, description in UPGRADES.items():
            if number <= from_version:
                continue
            parts.append(f"-- version {number}: {description}")
            for block in blocks(number, names):
                if block.kind == "concurrently":
                    parts.append(
                        "-- Outside a transaction. If it fails, DROP INDEX CONCURRENTLY the index it "
                        f"left invalid and run it again.\n{text(block.statement)}"
                    )
                else:
                    transaction(block.statement, locked=block.kind == "lock")
            transaction(_record(names, number, description), locked=False)
        parts.append("-- Whatever is missing yet (schema.sql is idempotent).")
        transaction(sql.schema(names))
    transaction(sql.functions(names, wake_slots))
    parts.append("-- Validate the constraints added NOT VALID (the rows breaking them were moved above).")
    transaction(statement("validate", names), locked=False)
    if lanes > 1:
        parts.append(
            f"-- The lanes index for lanes = {lanes}, outside a transaction. If it fails, DROP INDEX "
            "CONCURRENTLY the index it left invalid and run it again; then its function.\n"
            + text(lanes_statement("lanes_index", names, lanes))
        )
        transaction(lanes_statement("lanes_function", names, lanes), locked=False)
    return "\n\n".join(parts) + "\n"


class Autocommit:
    """A :class:`Runner` over a psycopg connection in autocommit mode (``drain migrate``)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        return self.conn.transaction()

    def execute(self, statement: pgsql.Composed) -> int:
        return self.conn.execute(statement).rowcount

    def fetch(self, statement: pgsql.Composed) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self.conn.execute(statement).fetchall()
        return rows

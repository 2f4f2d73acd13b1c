"""Schema versions: create a table at the current version, or upgrade an older one in place.

Each table records its versions in ``<table>_versions``; a table without one is version 1 (the
schema of drain 0.1.0). Every run first replaces the check function (``checks.sql``, which the
table's constraint calls). A fresh install then runs ``schema.sql``, the current schema, at once.
An older table runs the numbered steps after its version, ``upgrade_NNNN.sql`` (STEPS), while
producers stage and a drain forwards: each step is a list of blocks whose name says how it runs

- ``lock_*``: one transaction under ``lock_timeout`` (LOCK_TIMEOUT_MS), retried with backoff when
  it times out. A catalog change needs a brief ACCESS EXCLUSIVE lock, and while it *waits* for
  one, every producer's INSERT queues behind it: the timeout bounds that wait.
- ``rows_*``: one transaction changing rows, which takes no lock beyond theirs; ``rows_bury_*``
  moves rows to the dead letters (counted in the Report).
- ``concurrently_*``: one statement outside a transaction (``CREATE INDEX CONCURRENTLY``); the
  rest of the name is the index's (a placeholder of drain.store.sql.Names), dropped first if an earlier
  attempt left it invalid.

then records its version. A constraint is added ``NOT VALID`` (a brief lock), the rows already
there that break it are moved to the dead letters, with the problem as their error, and every run
ends by validating the table's ``drain_*`` constraints still NOT VALID (``validate``: SHARE UPDATE
EXCLUSIVE, which blocks neither producers nor the drain). Moving those rows rather than leaving
the constraint unvalidated, because a NOT VALID constraint still checks every row an UPDATE
writes: the drain's own UPDATE of such a row (a retry's backoff) would fail its whole batch.
After the schema, every run replaces the code objects (``functions.sql``).

Every block is idempotent, so a run cut short is finished by the next. To add version N: write
``drain/store/sql/upgrade_000N.sql`` (and the same change in schema.sql: a test checks both paths end in
the same catalog), append ``Step(N, ...)`` to STEPS, and add a Django migration that calls
:func:`upgrade` (drain/contrib/django/migrations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import psycopg
from psycopg import sql as pgsql

from drain import errors
from drain.store import sql

log = logging.getLogger(__name__)

LOCK_TIMEOUT_MS = 100  # the longest a producer's INSERT waits behind one of our catalog changes
LOCK_ATTEMPTS = 60  # then give up, saying which transactions to look at
LOCK_RETRY_BASE_S = 0.1
LOCK_RETRY_MAX_S = 2.0
LOCK_NOT_AVAILABLE = "55P03"
DEADLOCK_DETECTED = "40P01"
FIRST_VERSION = 1  # drain 0.1.0's schema, which recorded no version
MIGRATIONS_FILE = "migrations.sql"
BURY_PREFIX = "rows_bury_"  # a rows block that moves rows to the dead letters: counted

Kind = Literal["lock", "rows", "concurrently"]
KINDS: tuple[Kind, ...] = ("lock", "rows", "concurrently")


@dataclasses.dataclass(frozen=True)
class Step:
    """Schema version ``version``, reached from the one before by ``upgrade_NNNN.sql``."""

    version: int
    description: str

    @property
    def filename(self) -> str:
        return f"upgrade_{self.version:04d}.sql"


STEPS: tuple[Step, ...] = (
    Step(2, "dead letters numbered on their own; the table refuses what no backend can carry"),
    Step(3, "an ordering key on each row"),
)
LATEST_VERSION = STEPS[-1].version
KEYS_VERSION = 3
"""The version that gave rows (and dead letters) their ordering key: what `drain status`'s
blocked figures and `drain dead` need."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a step: how it runs (``kind``), its name, its statement, and for a
    ``concurrently`` block the placeholder of the index it builds."""

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


def blocks(step: Step, names: sql.Names) -> list[Block]:
    """The blocks of ``step`` in file order, filled in for this table."""
    found = []
    for name in sql.raw_queries(step.filename):
        prefix, _, rest = name.partition("_")
        kinds = {each: each for each in KINDS}
        if prefix not in kinds:
            raise ValueError(f"{step.filename}: block {name} has no kind ({', '.join(KINDS)})")
        kind = kinds[prefix]
        index = rest if kind == "concurrently" else None
        found.append(Block(kind, name, sql.template(step.filename, names, name), index))
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


def _drain_version() -> str:
    import drain  # at call time: drain/__init__ imports the modules that import this one

    return drain.__version__


def _record(names: sql.Names, version: int, description: str) -> pgsql.Composed:
    return statement(
        "record_version", names, version=version, description=description, drain_version=_drain_version()
    )


class _Migration:
    def __init__(self, runner: Runner, names: sql.Names, sleep: Callable[[float], None]) -> None:
        self.runner = runner
        self.names = names
        self.sleep = sleep

    def locked(self, statements: Sequence[pgsql.Composed], what: str) -> None:
        """Run ``statements`` in one transaction under the lock timeout, retrying a timeout."""
        timeout = statement("lock_timeout", self.names, lock_timeout=f"{LOCK_TIMEOUT_MS}ms")
        for attempt in range(1, LOCK_ATTEMPTS + 1):
            try:
                with self.runner.transaction():
                    self.runner.execute(timeout)
                    for each in statements:
                        self.runner.execute(each)
                return
            except Exception as exc:
                if sqlstate(exc) not in (LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED):
                    raise
                if attempt == LOCK_ATTEMPTS:
                    raise errors.SchemaError(
                        f"drain migrate: {what}: no lock on {self.names.qualified} in {LOCK_ATTEMPTS} "
                        f"tries of {LOCK_TIMEOUT_MS} ms; long transactions hold it (pg_stat_activity); "
                        "what is done stays done: run `drain migrate` again"
                    ) from None
                log.info(
                    "waiting for a brief lock on %s (%s)",
                    self.names.qualified,
                    what,
                    extra={"event": "migrate_lock_wait", "attempts": attempt},
                )
                self.sleep(min(LOCK_RETRY_BASE_S * 2.0 ** min(attempt - 1, 10), LOCK_RETRY_MAX_S))

    def run_block(self, block: Block, report: Report) -> None:
        if block.kind == "lock":
            self.locked([block.statement], block.name)
        elif block.kind == "rows":
            with self.runner.transaction():
                changed = self.runner.execute(block.statement)
            if block.name.startswith(BURY_PREFIX):
                report.buried += max(changed, 0)
        else:
            index = self.names.derived()[str(block.index)]
            ((invalid,),) = self.runner.fetch(statement("index_invalid", self.names, index=index))
            if invalid:
                self.runner.execute(statement("drop_index", self.names, index=index))
            self.runner.execute(block.statement)

    def validate(self, report: Report) -> None:
        with self.runner.transaction():
            self.runner.execute(statement("validate", self.names))
            ((not_valid,),) = self.runner.fetch(statement("validate_result", self.names))
        report.not_valid = [name for name in str(not_valid).split(",") if name]


def upgrade(
    runner: Runner,
    names: sql.Names,
    *,
    sleep: Callable[[float], None] = time.sleep,
    repair: bool = True,
) -> Report:
    """Bring the table to LATEST_VERSION, whatever its version, and report what it did.

    ``repair``: after the steps (or on a current table) run schema.sql again, which creates what
    is missing (a dropped index or table) and changes nothing else, as every `drain migrate` of
    0.1.0 did; the tests turn it off to see that the steps alone rebuild schema.sql. Raises
    SchemaError for a table newer than this drain (nothing is changed: an older release's
    functions would replace the newer ones) and when a lock stays out of reach.
    """
    runner.fetch(statement("lock", names))
    try:
        before = current_version(runner, names)
        if before > LATEST_VERSION:
            raise errors.SchemaError(
                f"{names.qualified} is at schema version {before}, newer than this drain's "
                f"{LATEST_VERSION}: nothing done; upgrade drain"
            )
        migration = _Migration(runner, names, sleep)
        report = Report(before, LATEST_VERSION)
        migration.locked([statement("versions_table", names), sql.checks(names)], "the check function")
        if before == 0:
            created = _record(names, LATEST_VERSION, f"created at version {LATEST_VERSION}")
            migration.locked([sql.schema(names), created], "create")
        for step in STEPS if before else ():
            if step.version > before:
                for block in blocks(step, names):
                    migration.run_block(block, report)
                with runner.transaction():
                    runner.execute(_record(names, step.version, step.description))
                log.info(
                    "%s: schema version %d (%s)",
                    names.qualified,
                    step.version,
                    step.description,
                    extra={"event": "migrated", "version": step.version},
                )
        if before and repair:
            migration.locked([sql.schema(names)], "the schema")
        migration.locked([sql.functions(names)], "functions")
        migration.validate(report)
        return report
    finally:
        runner.fetch(statement("unlock", names))


def script(names: sql.Names, from_version: int | None = None) -> str:
    """The SQL of :func:`upgrade` for a migration tool of one's own (``drain migrate --print``):
    a fresh install (``from_version`` None) or the upgrade of a table at ``from_version``.

    Transactions are spelled out; retry a ``lock_timeout`` error by running that transaction
    again. Every statement is idempotent, and a guard refuses the wrong starting point.
    """
    timeout = statement("lock_timeout", names, lock_timeout=f"{LOCK_TIMEOUT_MS}ms")
    parts: list[str] = []

    def text(composed: pgsql.Composed) -> str:
        return composed.as_string(None).strip()

    def transaction(*statements: pgsql.Composed, locked: bool = True) -> None:
        body = [text(timeout)] if locked else []
        parts.append("\n".join(["BEGIN;", *body, *(text(each) for each in statements), "COMMIT;"]))

    head = f"-- drain {_drain_version()}: {names.qualified}, schema version {LATEST_VERSION}"
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
        for step in STEPS:
            if step.version <= from_version:
                continue
            parts.append(f"-- version {step.version}: {step.description}")
            for block in blocks(step, names):
                if block.kind == "concurrently":
                    parts.append(
                        "-- Outside a transaction. If it fails, DROP INDEX CONCURRENTLY the index it "
                        f"left invalid and run it again.\n{text(block.statement)}"
                    )
                else:
                    transaction(block.statement, locked=block.kind == "lock")
            transaction(_record(names, step.version, step.description), locked=False)
        parts.append("-- Whatever is missing yet (schema.sql is idempotent).")
        transaction(sql.schema(names))
    transaction(sql.functions(names))
    parts.append("-- Validate the constraints added NOT VALID (the rows breaking them were moved above).")
    transaction(statement("validate", names), locked=False)
    return "\n\n".join(parts) + "\n"


class Session:
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

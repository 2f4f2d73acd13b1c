"""The SQL drain runs, loaded once from the ``.sql`` files beside this module.

Table and schema names are configurable, so every statement is a ``psycopg.sql.SQL`` template
whose ``{schema}``/``{table}``/``{dead}`` placeholders are filled with quoted identifiers, never
with string formatting. A block named in FRAGMENTS is not a statement but a piece that others
include by its name (``{dead_filter}``, ``{dead_agreed}``, ``{due_rows}``, ``{not_parked_in_place}``).

Every name drain derives from the table's (``<table>_dead``, its indexes, the staging function)
must fit PostgreSQL's identifiers, 63 bytes: a longer one is silently truncated, and two
truncated names can collide (``CREATE INDEX IF NOT EXISTS`` then skips the second index).
:class:`Names` refuses such a table, naming the setting.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any, LiteralString

from psycopg import sql as pgsql

from drain import errors
from drain.names import derived_names, lanes_function, name_problems

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A fragment may include earlier ones.
FRAGMENTS = (
    "not_parked_in_place",
    "lane_of",
    "in_lanes",
    "key_free",
    "due_now",
    "due_now_lanes",
    "dead_filter",
    "dead_agreed",
    "due_rows",
)
# The derived names statements use, by placeholder: what drain creates.
CREATED_NAMES = (
    "dead",
    "schedules",
    "versions",
    "due_index",
    "run_at_index",
    "dead_job_id_index",
    "dead_id_index",
    "key_index",
    "dead_key_index",
    "stage_function",
    "stage_function_v2",
)


def _read(filename: str) -> LiteralString:
    # Our own files, shipped in the package: as constant as a literal.
    text: LiteralString = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    return text


@functools.cache
def raw_queries(filename: str = "queries.sql") -> dict[str, LiteralString]:
    """Every named block of a queries file (queries.sql: the drain's; staging.sql: stage()'s), by name."""
    text = _read(filename)
    parts = _NAME_LINE.split(text)
    blocks: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        blocks[name] = body.strip()
    return blocks


@dataclasses.dataclass(frozen=True)
class Names:
    """The identifiers one staged-jobs table uses, quoted once.

    Raises ConfigError (naming ``schema`` or ``table``) when the schema's name or a name derived
    from the table's would pass PostgreSQL's 63 bytes.
    """

    schema: str
    table: str

    def __post_init__(self) -> None:
        problems = name_problems(self.schema, self.table)
        if problems:
            raise errors.ConfigError(problems)

    @property
    def dead(self) -> str:
        return f"{self.table}_dead"

    @property
    def schedules(self) -> str:
        return f"{self.table}_schedules"

    @property
    def versions(self) -> str:
        """The table's schema versions (drain.store.migrations): one row per version applied."""
        return f"{self.table}_versions"

    @property
    def qualified(self) -> str:
        """schema.table, quoted, for to_regclass and messages."""
        return f'"{self.schema}"."{self.table}"'

    def qualify(self, name: str) -> str:
        """schema.name, quoted, for to_regclass: another table of this schema."""
        return f'"{self.schema}"."{name}"'

    def derived(self) -> dict[str, str]:
        """Every name drain makes from the table's, by placeholder (see :func:`derived_names`)."""
        return derived_names(self.table)

    def identifiers(self) -> dict[str, pgsql.Identifier]:
        created = CREATED_NAMES
        derived = self.derived()
        return {
            "schema": pgsql.Identifier(self.schema),
            "table": pgsql.Identifier(self.table),
            **{key: pgsql.Identifier(derived[key]) for key in created},
        }

    @property
    def stage_function(self) -> str:
        """The SQL staging function: drain_stage_v1 for the default table, <table>_stage_v1 for
        another, so two tables in one schema never share (and overwrite) one function."""
        return self.derived()["stage_function"]

    @property
    def stage_function_v2(self) -> str:
        """Version 2 of the SQL staging function (an ordering key): drain_stage_v2, or
        <table>_stage_v2 beside <table>_stage_v1."""
        return self.derived()["stage_function_v2"]

    def literals(self) -> dict[str, pgsql.Literal]:
        """The names as SQL string literals, for statements that look them up in the catalog."""
        return {
            "schema_name": pgsql.Literal(self.schema),
            "table_name": pgsql.Literal(self.table),
            "dead_name": pgsql.Literal(self.dead),
            "versions_name": pgsql.Literal(self.versions),
            "qualified_table": pgsql.Literal(self.qualified),
            "qualified_dead": pgsql.Literal(self.qualify(self.dead)),
            "qualified_versions": pgsql.Literal(self.qualify(self.versions)),
        }


def _fragment(name: str) -> LiteralString:
    """A fragment's text without its comment lines (it is spliced into the middle of a line)."""
    lines = [line for line in raw_queries()[name].splitlines() if not line.startswith("--")]
    return "\n".join(lines)


def lane_of(lane_count: int) -> pgsql.Composed:
    """queries.sql ``lane_of`` with the count as a constant: the lanes index's expression
    (migrations.sql lanes_index), which the planner matches only in this form."""
    text = _fragment("lane_of").replace("%(lane_count)s::int", "{count}")
    return pgsql.SQL(text).format(count=pgsql.Literal(int(lane_count)))


@functools.cache
def query(name: str, names: Names, filename: str = "queries.sql", lane_count: int | None = None) -> pgsql.SQL:
    """The named statement with this table's identifiers and the fragments it uses filled in,
    rendered once: a plain SQL text, its comment lines and indentation left out. ``lane_count``:
    for a member of a table with that many lanes and their index, due rows now are read lane by
    lane (queries.sql due_now_lanes) instead of walking the due index (due_now).

    What each execution then costs the drain is encoding one string: a ``Composed`` is rendered
    part by part on every execute (each identifier escaped again), and a text over psycopg's
    4,096-byte cache is split into its parameters on every execute too (the batch query with its
    comments was 7 KB). At a steady trickle the relay runs half a dozen statements per handful of
    jobs, and that rendering was a tenth of the drain's CPU (bench/bench_cost.py --profile)."""
    identifiers = names.identifiers()
    if lane_count is not None:
        identifiers["lanes_function"] = pgsql.Identifier(lanes_function(names.table, lane_count))
    fragments: dict[str, pgsql.Composable] = {}
    for fragment in FRAGMENTS:
        if fragment == "due_now_lanes" and lane_count is None:
            continue
        fragments[fragment] = pgsql.SQL(_fragment(fragment)).format(**identifiers, **fragments)
        if fragment == "due_now_lanes":
            fragments["due_now"] = fragments[fragment]
    composed = pgsql.SQL(raw_queries(filename)[name]).format(**identifiers, **fragments)
    return pgsql.SQL(_compact(composed.as_string(None)))


@dataclasses.dataclass(frozen=True)
class Positional:
    """A statement with ``$1, $2, ...`` where its text had ``%(name)s``: what a
    ``psycopg.RawCursor`` executes as it is, and the parameter names in their order."""

    text: LiteralString
    order: tuple[str, ...]

    def params(self, values: Mapping[str, Any]) -> list[Any]:
        """The values for ``$1, $2, ...`` from a statement's named parameters."""
        return [values[name] for name in self.order]


_NAMED = re.compile(r"%\((\w+)\)s")


@functools.cache
def positional(name: str, names: Names, lane_count: int | None = None) -> Positional:
    """The named statement (:func:`query`) with positional parameters, converted once.

    For the batch query: psycopg caches its conversion of ``%(name)s`` only for texts up to
    4,096 bytes, and the batch query is larger, so each execute parsed it again for its 26
    placeholders (a tenth of a trickle step's CPU, bench/bench_cost.py --profile). ``lane_count``:
    as :func:`query`'s."""
    text = query(name, names, lane_count=lane_count).as_string(None)
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    converted = _NAMED.sub(number, text)
    if "%" in converted:  # a literal % would need psycopg's escaping: not in drain's statements
        raise ValueError(f"{name}: a '%' that is not a named parameter")
    kept: LiteralString = converted  # our own file, numbered
    return Positional(kept, tuple(order))


def _compact(text: str) -> LiteralString:
    """``text`` without its comment lines, blank lines and indentation. Only whole-line comments
    go (a statement here never continues a string literal over a line, which this would change)."""
    lines = (line.strip() for line in text.splitlines())
    kept: LiteralString = "\n".join(line for line in lines if line and not line.startswith("--"))
    return kept


def query_with(name: str, names: Names, **identifiers: pgsql.Identifier) -> pgsql.Composed:
    """The named statement with ``identifiers`` besides the table's (a channel's name, say:
    LISTEN takes no parameter)."""
    return pgsql.SQL(raw_queries()[name]).format(**names.identifiers(), **identifiers)


@functools.cache
def template(filename: str, names: Names, block: str | None = None) -> pgsql.Composed:
    """A whole .sql file (or one named block of it) with this table's identifiers, and its
    names as string literals, filled in."""
    text = _read(filename) if block is None else raw_queries(filename)[block]
    return pgsql.SQL(text).format(**names.identifiers(), **names.literals())


def schema(names: Names) -> pgsql.Composed:
    """The current schema, for a fresh install: the table, its indexes and constraints, the
    dead-letter, schedule-ticks and versions tables (drain.store.migrations upgrades older ones)."""
    return template("schema.sql", names)


def checks(names: Names) -> pgsql.Composed:
    """The function the table's constraint, the staging function and migrations check rows with
    (CREATE OR REPLACE: idempotent; run by every ``drain migrate``, before the schema)."""
    return template("checks.sql", names)


def functions(names: Names, wake_slots: int = 1) -> pgsql.Composed:
    """The SQL staging function and the wake-up triggers (CREATE OR REPLACE: idempotent; run by
    every ``drain migrate``, after the schema is current), with at least ``wake_slots`` wake
    slots (drain.relay.wakeup; 1: one drain sleeps armed, as without lanes)."""
    return pgsql.SQL(_read("functions.sql")).format(
        **names.identifiers(), **names.literals(), wake_slots=pgsql.Literal(int(wake_slots))
    )

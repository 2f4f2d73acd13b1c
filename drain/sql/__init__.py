"""The SQL drain runs, loaded once from the ``.sql`` files beside this module.

Table and schema names are configurable, so every statement is a ``psycopg.sql.SQL`` template
whose ``{schema}``/``{table}``/``{dead}`` placeholders are filled with quoted identifiers, never
with string formatting. A block named in FRAGMENTS is not a statement but a piece that others
include by its name (``{dead_filter}``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from importlib import resources
from typing import LiteralString

from psycopg import sql as pgsql

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
FRAGMENTS = ("dead_filter",)
STAGE_FUNCTION = "drain_stage_v1"
DEFAULT_TABLE = "staged_jobs"


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
    """The identifiers one staged-jobs table uses, quoted once."""

    schema: str
    table: str

    @property
    def dead(self) -> str:
        return f"{self.table}_dead"

    @property
    def schedules(self) -> str:
        return f"{self.table}_schedules"

    @property
    def qualified(self) -> str:
        """schema.table, quoted, for to_regclass and messages."""
        return f'"{self.schema}"."{self.table}"'

    def identifiers(self) -> dict[str, pgsql.Identifier]:
        return {
            "schema": pgsql.Identifier(self.schema),
            "table": pgsql.Identifier(self.table),
            "dead": pgsql.Identifier(self.dead),
            "due_index": pgsql.Identifier(f"{self.table}_due_idx"),
            "run_at_index": pgsql.Identifier(f"{self.table}_run_at_idx"),
            "dead_job_id_index": pgsql.Identifier(f"{self.dead}_job_id_idx"),
            "stage_function": pgsql.Identifier(self.stage_function),
            "schedules": pgsql.Identifier(self.schedules),
        }

    @property
    def stage_function(self) -> str:
        """The SQL staging function: drain_stage_v1 for the default table, <table>_stage_v1 for
        another, so two tables in one schema never share (and overwrite) one function."""
        return STAGE_FUNCTION if self.table == DEFAULT_TABLE else f"{self.table}_stage_v1"


def _fragment(name: str) -> LiteralString:
    """A fragment's text without its comment lines (it is spliced into the middle of a line)."""
    lines = [line for line in raw_queries()[name].splitlines() if not line.startswith("--")]
    return "\n".join(lines)


@functools.cache
def query(name: str, names: Names, filename: str = "queries.sql") -> pgsql.Composed:
    """The named statement with this table's identifiers and the fragments it uses filled in."""
    identifiers = names.identifiers()
    fragments = {fragment: pgsql.SQL(_fragment(fragment)).format(**identifiers) for fragment in FRAGMENTS}
    return pgsql.SQL(raw_queries(filename)[name]).format(**identifiers, **fragments)


@functools.cache
def schema(names: Names) -> pgsql.Composed:
    """The CREATE statements for this table, its indexes, its dead-letter table and its wake-up trigger."""
    literals = {"schema_name": pgsql.Literal(names.schema), "table_name": pgsql.Literal(names.table)}
    return pgsql.SQL(_read("schema.sql")).format(**names.identifiers(), **literals)


@functools.cache
def functions(names: Names) -> pgsql.Composed:
    """The SQL staging function for this table (CREATE OR REPLACE: idempotent)."""
    return pgsql.SQL(_read("functions.sql")).format(**names.identifiers())

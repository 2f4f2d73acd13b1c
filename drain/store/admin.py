"""The operator's queries (the CLI's and the console's): status figures, dead letters, the
leader, schedules. None is fenced: a command works on its own session, whether a drain leads or not.

Racing
------
- Two commands may act on the same dead letters at once, and the leader buries more meanwhile.
- Their writes run READ COMMITTED and take dead letters with SKIP LOCKED. A dead letter another
  transaction holds is skipped, and counted (``taken``) so the command can say so.
- So each dead letter is acted on once, by one command.
- A serialization failure or a deadlock still possible elsewhere (two retries staging the same
  job_id) is retried, at most RACE_ATTEMPTS times, then said in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg import postgres, rows
from psycopg.types import datetime as pg_datetime
from psycopg.types import json as pg_json

from drain import errors
from drain.observability import redaction
from drain.store import connection, migrations, session, sql, writes

T = TypeVar("T")
CHECK_ROWS = 1_000
"""A page's walk decides at most this many dead letters in Python (those masking may touch that
hold the term: under 0.1 ms each here, fetched and masked) ..."""
CHECK_BYTES = 4_000_000
"""... whose arguments, and under the error filter their errors, come to at most this many bytes
(Admin.dead_matching; the first is decided whatever its size: the next walk starts where one
ends)."""
ANY_CASE_CHARS = CHECK_BYTES // 8
"""The redacted errors a page's walk sends Postgres at once to compare them any case (the first
whatever its size): what they cost beyond what the walk holds (Admin._errors_shown)."""
WALK_ROWS = 20_000
"""An action's walk under a text search (Admin._matching_ids) reads the dead letters in windows
of this many by number, each fetched in pages of CHECK_ROWS and CHECK_BYTES at most."""


class Admin:
    """The operator's queries, on the connection it is given (drain.store.session.Store.conn)."""

    def __init__(self, conn: psycopg.Connection[Any], names: sql.Names) -> None:
        self._conn = conn
        self._names = names

    def schedules(self) -> tuple[list[dict[str, Any]], datetime.datetime]:
        """Every recorded schedule (name, cron, timezone, last_tick, last_job_id), and the
        database's now."""
        return self._rows("schedule_list"), session.Ticks(self._conn, self._names).now()

    def not_valid_constraints(self) -> list[str]:
        """The table's constraints still NOT VALID: rows in it break them."""
        found = self._conn.execute(migrations.statement("not_valid", self._names)).fetchall()
        return [str(row[0]) for row in found]

    def parked(self) -> int:
        """How many due rows are parked (Batch.park), or parked in place (Batch.park_in_place)."""
        return int(
            self._one("parked_count", {"parked_at": writes.PARKED_AT, "prefix": writes.PARKED_PREFIX})[0]
        )

    def drains(self) -> list[str]:
        """The application names of the drain sessions connected to this database."""
        return [str(row[0]) for row in self._conn.execute(sql.query("drains", self._names)).fetchall()]

    def leader(self, key: int) -> dict[str, Any] | None:
        """Who holds the leader lock exclusively (members of lanes hold it shared): pid,
        application_name, client_addr, backend_start."""
        classid, objid = connection.split_key(key)
        found = self._rows("leader", {"classid": classid, "objid": objid})
        return found[0] if found else None

    def estimates(self) -> dict[str, int | None]:
        """The planner's estimate of the rows of the table (``staged``) and of its dead letters
        (``dead``); None where it has none yet."""
        params = {"table": self._names.qualified, "dead": self._names.qualify(self._names.dead)}
        found = dict(zip(("staged", "dead"), self._one("estimates", params, (None, None)), strict=True))
        return {key: None if value is None or value < 0 else int(value) for key, value in found.items()}

    def limit_statements(self, ms: int) -> None:
        """Cancel any later statement of this session that runs longer than ``ms``."""
        self._conn.execute(sql.query("limit_statements", self._names), {"ms": str(ms)})

    def queue_backlog(self, cap: int) -> list[dict[str, Any]]:
        """Staged rows per backend and queue (due, scheduled, retrying), counted over the
        ``cap`` oldest rows of the table."""
        return self._rows("queue_backlog", {"cap": cap}, lenient=True)

    def may_act(self) -> dict[str, bool]:
        """Whether this session may retry and purge: ``primary`` (not a standby), ``writable``
        (not read-only), ``privileged`` (the role may insert into the table and delete dead letters)."""
        params = {"table": self._names.qualified, "dead": self._names.qualify(self._names.dead)}
        (found,) = self._rows("may_act", params)
        return {key: bool(value) for key, value in found.items()}

    # --- dead letters ---------------------------------------------------------------------

    def dead_list(self, filters: DeadFilter) -> list[dict[str, Any]]:
        """Dead letters matching ``filters``, oldest first. A value Python cannot hold comes as
        its text (_AsText): often the very reason the row died."""
        exact = self._exact(filters)
        return [] if exact is None else self._rows("dead_list", exact.params(), lenient=True)

    def dead_page(self, filters: DeadFilter, cut: int, args_bytes: int) -> list[dict[str, Any]]:
        """Dead letters matching ``filters``, newest first, at most ``filters.limit``. Each text is
        cut to ``cut`` characters, the error once redacted (this process's own secrets too); args
        and kwargs are None when larger than ``args_bytes``."""
        exact = self._exact(filters)
        if exact is None:
            return []
        reach = _error_reach(cut)
        params = {**exact.params(), "cut": cut, "error_cut": reach, "args_bytes": args_bytes}
        found = self._rows("dead_page", params, lenient=True)
        for row in found:
            error = row["error"]
            if isinstance(error, str):  # read to ``reach``: a secret may be cut off at its end
                shown = redaction.redact_cut(error) if len(error) >= reach else redaction.redact(error)
                row["error"] = shown[:cut]
        return found

    def dead_matching(
        self,
        filters: DeadFilter,
        cap: int,
        scan: int | None,
        *,
        check_rows: int = CHECK_ROWS,
        check_bytes: int = CHECK_BYTES,
    ) -> Matching:
        """A page's walk: the dead letters numbered ``filters.upto`` and below, newest first, at
        most ``scan`` of them (None: all), and among them those matching ``filters``, counted up
        to ``cap`` (the walk stops there: ``cap`` means that many or more), with the dead_id of
        the newest ``filters.limit`` of those.

        A text search matches what a page shows (DeadFilter): Postgres takes the candidates and
        decides those no masking can touch, Python the others, at most ``check_rows`` of them,
        whose arguments come to ``check_bytes`` at most. The walk ends where that bound cuts it
        (``unreached``: the next walk starts there).
        """
        if filters.error is None and filters.arg is None:  # Postgres alone: one statement
            params = {**filters.params(), "cap": cap, "scan": scan}
            row = self._conn.execute(sql.query("dead_matching", self._names), params).fetchone()
            assert row is not None
            unreached = None if row[2] is None else int(row[2])
            return Matching(int(row[0]), [int(each) for each in row[1]], unreached)
        floor = None
        if scan is not None:
            params = {**filters.params(), "scan": scan}
            bound = self._conn.execute(sql.query("dead_scan_bound", self._names), params).fetchone()
            floor = None if bound is None else int(bound[0])
        found: list[int] = []
        upto, checked, spent = filters.upto, 0, 0
        while True:
            wanted = cap - len(found)
            taken = dataclasses.replace(filters, upto=upto)
            batch = self._candidates(taken, floor, wanted, check_rows - checked, check_bytes - spent)
            for dead_id, shown, size in batch:
                if size is None:  # the walk ends here
                    return Matching(len(found), found[: filters.limit], dead_id, cut=True)
                checked, spent = checked + (size > 0), spent + size
                if shown:
                    found.append(dead_id)
            if len(found) >= cap or len(batch) < wanted:
                return Matching(len(found), found[: filters.limit], floor)
            upto = batch[-1][0] - 1  # Python passed over some: on to the next candidates

    def _candidates(
        self,
        filters: DeadFilter,
        floor: int | None,
        cap: int | None,
        check_rows: int | None = None,
        check_bytes: int | None = None,
    ) -> list[tuple[int, bool, int | None]]:
        """The dead letters ``filters`` may match (queries.sql dead_candidates), numbered above
        ``floor``, newest first, at most ``cap``: each with whether it matches what a page shows,
        and the bytes of arguments Python read to decide it (0: Postgres decided). Python decides
        at most ``check_rows``, whose arguments come to ``check_bytes`` at most (None: no bound);
        the list ends with the first it leaves undecided (its bytes None)."""
        params = {**filters.params(), "floor": floor, "cap": cap, "bytes": check_bytes, "searching": True}
        with self._conn.cursor() as cursor:
            cursor.adapters.register_loader("jsonb", _AsText)
            # never prepared: on a reused session, the generic plan Postgres took after five runs
            # (blind to which searches are null) took ten times as long here
            found = [  # lists: each error goes once redacted (Admin._errors_shown)
                list(row)
                for row in cursor.execute(
                    sql.query("dead_candidates", self._names), params, prepare=False
                ).fetchall()
            ]
        taken: list[list[Any]] = []
        checking = 0
        for row in found:
            if not row[1]:
                if not row[5] or (check_rows is not None and checking == check_rows):
                    break
                checking += 1
            taken.append(row)
        decided: list[tuple[int, bool, int | None]] = []
        any_case = iter(self._errors_shown(taken, filters.error) if filters.error else [])
        for dead_id, settled, _, job_args, job_kwargs, _, size in taken:
            if settled:
                decided.append((int(dead_id), True, 0))
                continue
            error_shown = next(any_case) if filters.error else True
            arg_shown = filters.arg is None or _arg_shown([job_args, job_kwargs], filters.arg)
            decided.append((int(dead_id), error_shown and arg_shown, max(int(size), 1)))
        if len(taken) < len(found):
            decided.append((int(found[len(taken)][0]), False, None))
        return decided

    def _errors_shown(self, taken: list[list[Any]], term: str) -> list[bool]:
        """Whether the error of each of the candidates ``taken`` Python decides holds ``term`` as a
        page shows it (redaction.redact). Each fetched error goes once redacted, and the redacted
        ones go to Postgres (Admin._any_case) by ANY_CASE_CHARS at most (the one whatever its
        size): the errors are held about twice, not four times (fetched, redacted, sent)."""
        shown: list[bool] = []
        texts: list[str] = []
        held = 0
        for row in taken:
            if row[1]:
                continue
            text = redaction.redact(row[2] or "")
            row[2] = None
            texts.append(text)
            held += len(text)
            if held >= ANY_CASE_CHARS:
                shown += self._any_case(texts, term)
                texts, held = [], 0
        if texts:
            shown += self._any_case(texts, term)
        return shown

    def _any_case(self, texts: list[str], term: str | None) -> list[bool]:
        """Whether each of ``texts`` holds ``term``, any case as Postgres compares them (as the
        error filter does where no masking touches the error)."""
        found = self._conn.execute(sql.query("dead_any_case", self._names), {"texts": texts, "term": term})
        return [bool(row[0]) for row in found]

    def _exact(self, filters: DeadFilter) -> DeadFilter | None:
        """``filters`` with its text searches replaced by the dead letters they match on what a
        page shows (their ids), or None where none does; as it is without text searches."""
        if filters.error is None and filters.arg is None:
            return filters
        ids = self._matching_ids(filters)
        if filters.limit is not None:  # the oldest, as dead_list takes them
            ids = sorted(ids)[: max(filters.limit, 0)]
        if not ids:
            return None
        return dataclasses.replace(filters, ids=ids, error=None, arg=None)

    def _matching_ids(self, filters: DeadFilter) -> list[int]:
        """The dead_id of every dead letter ``filters`` matches on what a page shows, newest first:
        what an action's confirmation counts and the action takes (Admin._exact).

        Memory
        ------
        - A walk of the candidates (Admin._candidates) by dead_id, newest first, a window of
          WALK_ROWS dead letters a statement.
        - Each fetch holds at most CHECK_ROWS of them, their arguments CHECK_BYTES at most (the
          first whatever its size). The next fetch starts where one ends.
        - Only the matching ids stay; each page's text goes once decided.

        Time
        ----
        - The walk as a whole is bounded as one statement is: by the session's statement_timeout.
        - Past it, it stops with QueryCanceled, as a statement would (the console: "The query took
          longer than N s: narrow the filter."). Nothing was changed.
        """
        timeout_ms = int(self._one("session_timeouts", {})[0] or 0)
        started = time.monotonic()
        found: list[int] = []
        upto = filters.upto
        while True:
            if timeout_ms and (time.monotonic() - started) * 1000 > timeout_ms:
                raise psycopg.errors.QueryCanceled(
                    f"the search of the dead letters took longer than the statement_timeout ({timeout_ms} ms)"
                )
            bound = self._one("dead_scan_bound", {"upto": upto, "scan": WALK_ROWS}, (None,))[0]
            floor = None if bound is None else int(bound)
            batch = self._candidates(
                dataclasses.replace(filters, upto=upto), floor, CHECK_ROWS, CHECK_ROWS, CHECK_BYTES
            )
            found += [dead_id for dead_id, shown, _ in batch if shown]
            if batch and batch[-1][2] is None:  # left undecided: the next page starts with it
                upto = batch[-1][0]
            elif len(batch) == CHECK_ROWS:  # a full page: more in this window
                upto = batch[-1][0] - 1
            elif floor is None:
                return found
            else:
                upto = floor

    def dead_extent(self, filters: DeadFilter) -> tuple[Counted, int]:
        """How many dead letters match ``filters`` (with the digest of their set), and the highest
        dead_id among them (0: none): what an action confirmed is bound to (DeadFilter.upto, and
        dead_retry's ``confirmed``)."""
        exact = self._exact(filters)
        if exact is None:
            return Counted(0, digest([])), 0
        count, highest, counted = self._one("dead_extent", exact.params(), (0, 0, digest([])))
        return Counted(int(count), str(counted)), int(highest)

    def _rows(
        self, query: str, params: dict[str, Any] | None = None, *, lenient: bool = False
    ) -> list[dict[str, Any]]:
        """The rows of one query as dicts; ``lenient``: a value Python cannot hold as its text."""
        with self._conn.cursor(row_factory=rows.dict_row) as cursor:
            if lenient:
                names = ["jsonb", "timestamptz"]
                if self._conn.info.encoding == "ascii":  # a SQL_ASCII database: names may not be UTF-8
                    names += connection.TEXT_TYPES
                for name in names:
                    cursor.adapters.register_loader(name, _AsText)
            cursor.execute(sql.query(query, self._names), params)
            return cursor.fetchall()

    def _one(self, query: str, params: dict[str, Any], default: tuple[Any, ...] = (0,)) -> tuple[Any, ...]:
        """The one row of a query, or ``default``."""
        return self._conn.execute(sql.query(query, self._names), params).fetchone() or default

    def dead_retry(self, filters: DeadFilter, confirmed: int | None = None) -> Acted:
        """Move matching dead letters back to the table.

        - ``confirmed``: the count an operator confirmed; a Counted (dead_extent's) names the set
          too. Unless as many match now, and (a Counted) the same ones, in the act's own statement,
          none is moved: Acted.changed says how many match.

        - Each gets a new row id (a keyed one its own back: queries.sql dead_retry), keeps its
          job_id, and is due now with attempts reset.
        - A dead letter whose job_id is staged again already stays where it is.
        - All in one transaction, unless a dead letter breaks one of the table's constraints
          (buried by `drain migrate`, or before the table had them). Then one at a time, newest
          first (as the single statement prefers the newest of a job_id); those the table
          refuses stay dead.
        """
        filters, unmatched = self._searched(filters, confirmed)
        if unmatched is not None:
            return unmatched
        try:
            moved, matched, locked, agreed = self._racing(functools.partial(self._retry, filters, confirmed))
            if not agreed:
                return Acted(0, changed=matched)
            return Acted(moved, 0, matched - locked, locked - moved)
        except REFUSED_BY_TABLE:
            pass
        ids = [
            int(row[0]) for row in self._conn.execute(sql.query("dead_ids", self._names), filters.params())
        ]
        if not _agreed(ids, confirmed):
            return Acted(0, changed=len(ids))
        moved = refused = taken = staying = 0
        for dead_id in ids:
            try:
                one, matched, locked, _ = self._racing(
                    functools.partial(self._retry, DeadFilter(ids=[dead_id]))
                )
                moved, taken, staying = moved + one, taken + matched - locked, staying + locked - one
            except REFUSED_BY_TABLE:
                refused += 1
        return Acted(moved, refused, taken, staying)

    def _retry(self, filters: DeadFilter, confirmed: int | None = None) -> tuple[int, int, int, bool]:
        """One dead_retry statement in its own transaction: (moved, matched, locked, agreed: the
        set matching is the one confirmed, or none was)."""
        with self._transaction():
            moved, matched, locked, agreed = self._one(
                "dead_retry",
                {**filters.params(), "qualified": self._names.qualified, **_confirmation(confirmed)},
            )
        return int(moved), int(matched), int(locked), bool(agreed)

    def dead_purge(self, filters: DeadFilter, confirmed: int | None = None) -> Acted:
        """Delete matching dead letters (``confirmed``: as dead_retry's).

        A keyed dead letter may hold the rows of its key (block_on_dead_letter). Its purge then
        wakes a sleeping leader at commit (wake_due), as a producer's INSERT does. A role that
        may not update the table purges all the same: the leader finds those rows at its next poll.
        """
        filters, unmatched = self._searched(filters, confirmed)
        if unmatched is not None:
            return unmatched
        return self._racing(functools.partial(self._purge, filters, confirmed))

    def _searched(self, filters: DeadFilter, confirmed: int | None) -> tuple[DeadFilter, Acted | None]:
        """An action's filter with its text searches replaced by the dead letters they match
        (Admin._exact; the act takes those ids, and none when one went meanwhile); or what the
        action did when it takes none: none match, or not the set ``confirmed`` counted (the act's
        statement checks it again, on those ids)."""
        exact = self._exact(filters)
        if exact is filters:
            return filters, None
        ids = [] if exact is None else list(exact.ids or ())
        if not _agreed(ids, confirmed):
            return filters, Acted(0, changed=len(ids))
        return (filters, Acted(0)) if exact is None else (exact, None)

    def _purge(self, filters: DeadFilter, confirmed: int | None) -> Acted:
        with self._transaction():
            purged, keyed, matched, agreed = self._one(
                "dead_purge", {**filters.params(), **_confirmation(confirmed)}
            )
            if not agreed:
                return Acted(0, changed=int(matched))
            if keyed:
                try:
                    with self._conn.transaction():
                        self._conn.execute(sql.query("wake_due", self._names))
                except psycopg.errors.InsufficientPrivilege:
                    pass
        return Acted(int(purged), taken=int(matched) - int(purged))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A READ COMMITTED transaction (see Racing); the session keeps its own level after it."""
        level = self._conn.isolation_level
        self._conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        try:
            with self._conn.transaction():
                yield
        finally:
            self._conn.isolation_level = level

    def _racing(self, write: Callable[[], T]) -> T:
        """Run ``write`` (one transaction), again after a serialization failure or a deadlock
        with another command, at most RACE_ATTEMPTS times; then one line (DrainError)."""
        for _ in range(RACE_ATTEMPTS - 1):
            with contextlib.suppress(*RACES):
                return write()
        try:
            return write()
        except RACES:
            raise errors.DrainError(
                f"other commands kept changing these dead letters ({RACE_ATTEMPTS} attempts); "
                "nothing was changed by this one: run it again"
            ) from None


class Acted(NamedTuple):
    """What `drain dead retry` or `drain dead purge` did."""

    done: int
    """Dead letters staged again, or purged."""
    refused: int = 0
    """Dead letters the table refused (a retry's)."""
    taken: int = 0
    """Dead letters another command held meanwhile: skipped (see Racing)."""
    staying: int = 0
    """Dead letters left as their job_id is staged again already (a retry's)."""
    changed: int | None = None
    """How many match now, when not the set confirmed (not as many, or not the same): none was
    touched."""


class Counted(int):
    """A count of dead letters that names the set it counted: ``digest`` (Admin.dead_extent's, as
    digest() makes it). An action given one as ``confirmed`` takes none unless that very set
    matches (a plain int: unless as many do)."""

    digest: str

    def __new__(cls, count: int, counted: str) -> Counted:
        made = super().__new__(cls, count)
        made.digest = counted
        return made


def digest(ids: Iterable[int]) -> str:
    """The digest of a set of dead letters (their dead_id): sha256, in hex, of the ids in order,
    comma-separated, as queries.sql dead_extent and dead_retry compute it."""
    return hashlib.sha256(",".join(map(str, sorted(ids))).encode()).hexdigest()


def _confirmation(confirmed: int | None) -> dict[str, Any]:
    """An act statement's ``confirmed`` and ``digest`` parameters (None: not checked)."""
    return {
        "confirmed": None if confirmed is None else int(confirmed),
        "digest": confirmed.digest if isinstance(confirmed, Counted) else None,
    }


def _agreed(ids: Sequence[int], confirmed: int | None) -> bool:
    """Whether the dead letters ``ids`` are the set ``confirmed`` counted (None: any set)."""
    if confirmed is None:
        return True
    if len(ids) != confirmed:
        return False
    return not isinstance(confirmed, Counted) or digest(ids) == confirmed.digest


class Matching(NamedTuple):
    """A page's walk of the dead letters (Admin.dead_matching): how many match (up to its cap),
    the newest of them (dead_id, newest first), and the number of the newest dead letter the walk
    did not reach (None: it read them all); ``cut``: the walk ended there as Python decided as
    many dead letters as it may a walk (Admin.dead_matching), before the end of its window."""

    matching: int
    newest: list[int]
    unreached: int | None
    cut: bool = False


@dataclasses.dataclass(frozen=True)
class DeadFilter:
    """Which dead letters a command applies to; None matches everything.

    - backend, queue, job_name, ordering_key: equal to it. ids: their dead_id.
    - since, until: died at or after ``since``, before ``until``.
    - error: a substring of the error, any case. arg: of a key or a value among the arguments,
      at any depth. Each searches what a page shows, never what it masks (redaction.redact and
      masked, this process's own secrets too): Postgres takes the candidates and decides where
      no masking can touch a row (queries.sql dead_filter, dead_settled), Python elsewhere, on
      what a page shows (Admin._candidates). Neither has an index: each reads every row it is
      asked about; the caller bounds them.
    - limit: at most this many, oldest first (a page: newest first).
    - upto: dead_id at most this, the highest a confirmation counted. A dead letter numbered
      above it waits for a confirmation of its own; one numbered below it but committed after
      the count (dead_id is handed out at INSERT) is caught by the set the act carries
      (Admin.dead_retry's ``confirmed``, a Counted).
    """

    backend: str | None = None
    queue: str | None = None
    job_name: str | None = None
    ids: Sequence[int] | None = None
    limit: int | None = None
    ordering_key: str | None = None
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None
    error: str | None = None
    arg: str | None = None
    upto: int | None = None

    @property
    def everything(self) -> bool:
        chosen = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        del chosen["limit"]
        return all(value in (None, (), []) for value in chosen.values())

    def params(self) -> dict[str, Any]:
        return {
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)},
            "ids": list(self.ids) if self.ids else None,
            # a term touching one of this process's own secrets (redaction.hide) finds nothing:
            # the pages hide them, the SQL never sees them
            "hidden_term": any(
                redaction.hidden_by_term(term) for term in (self.error, self.arg) if term is not None
            ),
            "hidden": redaction.hidden(),
            "searching": False,  # a text search is Admin._candidates' alone
            **_REDACTION,
        }


# what the text filters leave unsearched, as redaction.py hides it (its patterns are also Postgres's)
_REDACTION = {
    "url_password": redaction.URL_PASSWORD,
    "url_mask": rf"\1:{redaction.MASK}@",
    "pair_password": redaction.PAIR_PASSWORD,
    "pair_mask": rf"\1{redaction.MASK}",
    "pair_word": redaction.PAIR_WORD,
    "secret_words": redaction.SECRET_WORDS,
    "normal_drop": redaction.NORMAL_DROP,
    "folded": "".join(redaction.FOLDED),
    "folded_to": "".join(redaction.FOLDED.values()),
    # a JSON text's escape (\n, \", \u001f): what a name's character is there, before NORMAL_DROP
    "json_escape": r"\\(?:u[0123456789abcdefABCDEF]{4}|.)",
}


def _error_reach(cut: int) -> int:
    """How much of an error dead_page reads for its first ``cut`` characters once redacted: every
    own secret (redaction.hide) that starts within them whole, and the text each one's ``***``
    leaves room for (at most one per MASK's length of the cut). Postgres redacted the patterns
    before; a secret only Python knows, cut by Postgres, would leave a prefix no secret matches."""
    longest = max(map(len, redaction.hidden()), default=0)
    return cut if not longest else cut + (cut // len(redaction.MASK) + 2) * longest


def _arg_shown(values: list[Any], term: str) -> bool:
    """Whether ``term`` is a piece of a key or of a value (a string, or a number's, a boolean's,
    null's JSON) among ``values`` as a page shows them (redaction.masked, as drain.console.text
    does); never among arguments a page cannot mask (their JSON as text: shown as their size)."""
    try:
        return any(_holds(redaction.masked(value), term) for value in values if not isinstance(value, str))
    except RecursionError:
        return False


def _holds(value: Any, term: str) -> bool:
    if isinstance(value, dict):
        return any(term in str(key) or _holds(item, term) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds(item, term) for item in value)
    return term in (value if isinstance(value, str) else json.dumps(value, default=str))


REFUSED_BY_TABLE = (psycopg.errors.InvalidParameterValue, psycopg.errors.CheckViolation)
RACES = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
RACE_ATTEMPTS = 5


class _AsText(psycopg.adapt.Loader):
    """A value as its own loader reads it, or as its text where Python cannot hold it.

    - jsonb: nested too deep, or with too long a number.
    - timestamptz: outside ``datetime``'s range.
    - text on a SQL_ASCII database: not UTF-8.
    """

    _fails: tuple[type[Exception], ...]

    def __init__(self, oid: int, context: psycopg.abc.AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        own, self._fails = _OWN_LOADERS.get(oid, (None, ()))
        self._own = None if own is None else own(oid, context)

    def load(self, data: Any) -> Any:
        if self._own is not None:
            try:
                return self._own.load(data)
            except self._fails:
                pass
        return bytes(data).decode("utf-8", "replace")


_OWN_LOADERS: dict[int, tuple[type[psycopg.adapt.Loader], tuple[type[Exception], ...]]] = {
    postgres.types["jsonb"].oid: (pg_json.JsonbLoader, (ValueError, RecursionError)),
    postgres.types["timestamptz"].oid: (pg_datetime.TimestamptzLoader, (psycopg.DataError,)),
}

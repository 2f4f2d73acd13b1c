"""Lanes: more than one drain forwarding one table, each leading its share of the table's lanes.

With ``lanes = 1`` (the default) one drain leads the whole table (drain.relay.leadership). With
``lanes = N`` the table's rows fall into N lanes, and each live drain leads about N / M of them
(M drains: ⌈N/M⌉ or ⌊N/M⌋ each), standing by for the rest.

A row's lane:
    Computed by the server from what the row was staged with (queries.sql ``in_lanes``): its
    ordering key, so every row of a key is in one lane, or its job id. Nothing an app stages
    changes; every staging path gets it. A batch selects only the lanes its drain leads.

The locks, all session-level advisory locks on the drain's own session:
    - the table's leader lock, *shared*: a member. A drain of one lane takes that lock
      exclusively, so the two kinds never lead one table at once;
    - ``MEMBERS + N`` in the table's lane key space, shared: "a member running with N lanes";
    - lane ``i`` in the same space, exclusive: the lane's leader.

A balance (at the term's start, then every ``standby_retry_s``) reads who holds what
(``pg_locks``, one statement) and moves toward a fair share (:func:`plan`): take free lanes,
or hand some over. A lane is handed over only once every batch in flight is settled (deleted):
its next leader's first select, a transaction begun after the unlock, sees none of them.

Every batch is fenced by every lane it leads (``Batch.check_lanes``), as one lane is by its
lock. A drain that dies loses its lanes with its session, within the bound one leader has.

Per-key order across a hand-over is kept by the table itself: a keyed row is selected only when
no lower row of its key is left (queries.sql ``key_free``), whoever leads.

Every drain of a table must run with the same lane count. One that finds a member running with
another count, while it leads no lane, stands by and says why: the count changes when the last
drain of the old count stops (docs/operations/scaling.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drain import config, errors
from drain import names as db_names
from drain.observability import metrics
from drain.relay import leadership
from drain.store import session as store

log = logging.getLogger(__name__)

MEMBERS = 1 << 20
"""In a table's lane key space, ``MEMBERS + N`` is the shared lock of a member running with N lanes."""


def lane_space(schema: str, table: str) -> int:
    """A table's lane key space: the first half of a two-part advisory lock key (31 bits)."""
    digest = hashlib.blake2b(f"drain-lanes:{schema}.{table}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one balance does: take up to ``take`` of ``free`` lanes, or hand ``release`` over."""

    take: int
    release: int
    free: tuple[int, ...]


INDEX_LOOK_EVERY_S = 30.0
"""How often a member looks again whether the lanes index serves its count (Store.lanes_index_problem)."""
SILENT_BALANCES = 2.5
"""A member whose session has run no statement for this many balance intervals is not counted
(frozen: SIGSTOP, a hung VM). A member that turns runs one at least every interval (its balance,
or its standby's try, 1.5 intervals at most); one that does not would hold back, until its session
ends, the free lanes it is owed. Counted again from its next statement."""


def plan(lanes: int, mine: int, others: Mapping[int, int], held: set[int]) -> Plan:
    """A fair share for a drain leading ``mine`` lanes of ``lanes``, beside ``others`` (each
    other member's backend pid: how many it leads); ``held`` are the lanes anyone leads.

    Each of M members ends with ⌈N/M⌉ or ⌊N/M⌋: one above ⌈N/M⌉ hands the excess over; one at
    ⌈N/M⌉ hands one over while another member is below ⌊N/M⌋; free lanes go to those below their
    share, those below ⌊N/M⌋ first.
    """
    members = len(others) + 1
    high, low = -(-lanes // members), lanes // members
    free = tuple(lane for lane in range(lanes) if lane not in held)
    needy = any(count < low for count in others.values())
    if mine > high:
        return Plan(0, mine - high, free)
    if needy and mine > low:
        return Plan(0, 1, free)
    want = (low if needy else high) - mine
    return Plan(max(0, min(want, len(free))), 0, free)


class Lanes(leadership.Leadership):
    """The lanes of one staged-jobs table this drain leads, on the Store's session."""

    shared = True

    def __init__(
        self,
        db: store.Store,
        lanes: int,
        *,
        balance_every_s: float,
        clock: Callable[[], float] = time.monotonic,
        shuffle: Callable[[list[int]], None] = random.shuffle,
        metrics_: metrics.Metrics | None = None,
    ) -> None:
        super().__init__(db)
        self.lanes = lanes
        self._metrics = metrics_
        self.space = lane_space(db.settings.schema, db.settings.table)
        self.led: set[int] = set()
        self._balance_every_s = balance_every_s
        self._balanced_at = float("-inf")
        self._clock = clock
        self._shuffle = shuffle
        self._mismatch_said: int | None = None
        self._index_looked_at = float("-inf")
        self._index_said = False
        self._led_changed()

    @property
    def is_leader(self) -> bool:
        return self.pid is not None and bool(self.led)

    @property
    def leads_schedules(self) -> bool:
        """Lane 0's leader stages the schedules' ticks: once per tick, whatever the lanes."""
        return self.pid is not None and 0 in self.led

    def try_acquire(self) -> bool:
        """Become a member (the leader lock shared, after every check one leader makes), then
        take a fair share of the free lanes. True when this drain leads at least one."""
        if self.pid is None:
            if not super().try_acquire():
                return False
            self._store.try_lane(self.space, MEMBERS + self.lanes, shared=True)
        self._balanced_at = float("-inf")
        self.balance(lambda: True)
        return self.is_leader

    def _take(self) -> tuple[bool, int]:
        return self._store.try_lock_shared(self.key)

    def _untake(self) -> None:
        self._store.unlock_shared(self.key)

    def verify(self, batch: store.Batch) -> None:
        """Fence one batch by every lane this drain leads."""
        if not self.is_leader:
            raise errors.LeadershipLost("not the leader of any lane")
        assert self.pid is not None
        batch.check_lanes(self.space, sorted(self.led), self.pid)

    def balance(self, settle: Callable[[], bool]) -> None:
        """At most every ``balance_every_s``: move toward a fair share (:func:`plan`). Lanes are
        handed over only when ``settle`` (settle everything in flight) returns True."""
        now = self._clock()
        if self.pid is None or now - self._balanced_at < self._balance_every_s:
            return
        self._balanced_at = now
        members: dict[int, int] = {}
        counts: dict[int, int] = {}
        held: set[int] = set()
        silent: set[int] = set()
        for pid, lane, shared, quiet_s in self._store.lane_holders(self.space):
            if shared and lane >= MEMBERS:
                members[pid] = lane - MEMBERS
                if quiet_s is not None and quiet_s >= SILENT_BALANCES * self._balance_every_s:
                    silent.add(pid)
            elif not shared and lane < MEMBERS:
                held.add(lane)
                counts[pid] = counts.get(pid, 0) + 1
        if self._mismatched(members):
            return
        if now - self._index_looked_at >= INDEX_LOOK_EVERY_S:
            self._look_for_index(now)
        if self._metrics is not None:  # a failed select through it turns it off (Batch.select_due)
            self._metrics.set_lanes_indexed(self._store.reader.lanes_indexed)
        others = {pid: counts.get(pid, 0) for pid in members if pid not in (self.pid, *silent)}
        step = plan(self.lanes, len(self.led), others, held)
        if step.release and settle():
            self._hand_over(sorted(self.led, reverse=True)[: step.release])
        elif step.take:
            self._take_free(list(step.free), step.take)

    def balance_in_s(self) -> float | None:
        """An idle member wakes for its next balance: the lanes of a drain that died are taken
        within ``balance_every_s``, however long the wake-up lets it sleep."""
        if self.pid is None:
            return None
        return max(0.0, self._balanced_at + self._balance_every_s - self._clock())

    def _mismatched(self, members: Mapping[int, int]) -> bool:
        """Whether a member runs with another lane count. Leading no lane, this drain then stands
        by (``blocker``) and leaves: the drains of the other count go on."""
        other = next((count for count in members.values() if count != self.lanes), None)
        if other is None:
            self._mismatch_said = None
            return False
        if self.led:
            if self._mismatch_said != other:
                log.warning(
                    "another drain of %s runs with lanes = %d, this one with %d: it stands by while "
                    "this one leads",
                    self._store.names.qualified,
                    other,
                    self.lanes,
                    extra={"event": "lanes_mismatch", "lanes": self.lanes, "other_lanes": other},
                )
                self._mismatch_said = other
            return True
        self.release()
        self.blocker = leadership.Blocker(
            leadership.LANES,
            f"another drain of {self._store.names.qualified} runs with lanes = {other}, this one "
            f"with {self.lanes}: every drain of a table runs with the same count; this one stands by "
            "until no drain of the other count is left",
        )
        return True

    def _look_for_index(self, now: float) -> None:
        """Whether the lanes index and function of this count serve (then a select with a window
        reads this drain's lanes through them), said once when they do not."""
        self._index_looked_at = now
        problem = self._store.lanes_index_problem(self.lanes)
        self._store.reader.lanes_indexed = problem is None
        if problem is not None and not self._index_said:
            self._index_said = True
            warning = index_warning(self._store, self.lanes, problem)
            log.warning("%s", warning, extra={"event": "lanes_index_missing", "lanes": self.lanes})

    def _take_free(self, free: list[int], count: int) -> None:
        self._shuffle(free)
        for lane in free:
            if count <= 0:
                break
            if self._store.try_lane(self.space, lane):
                self.led.add(lane)
                count -= 1
        self._led_changed()

    def _hand_over(self, lanes: list[int]) -> None:
        for lane in lanes:
            self._store.unlock_lane(self.space, lane)
            self.led.discard(lane)
        self._led_changed()
        log.info(
            "handed over lanes %s of %s",
            ",".join(map(str, lanes)),
            self._store.names.qualified,
            extra={"event": "lanes_handed_over", "lanes_released": lanes, "lanes_led": sorted(self.led)},
        )

    def _led_changed(self) -> None:
        reader = self._store.reader
        reader.lane_count = self.lanes
        others = [str(lane) for lane in range(self.lanes) if lane not in self.led]
        # leading every lane: every row (in_lanes folded away, no lane computed for a row)
        reader.other_lanes = "{" + ",".join(others) + "}" if others else None
        reader.led_lanes = "{" + ",".join(str(lane) for lane in sorted(self.led)) + "}"
        reader.led_count = len(self.led)
        if self._metrics is not None:
            self._metrics.set_lanes(self.lanes, self.led)

    def forget(self) -> None:
        super().forget()
        self.led.clear()
        self._led_changed()

    def release(self) -> None:
        """Unlock every lane, then the membership; errors are ignored (closing the session frees
        them too)."""
        if self.pid is not None:
            try:
                for lane in sorted(self.led):
                    self._store.unlock_lane(self.space, lane)
                self._store.unlock_lane(self.space, MEMBERS + self.lanes, shared=True)
            except Exception as exc:  # noqa: BLE001 - the session ending releases them anyway
                log.debug("unlock failed (%s); closing the session releases the lanes", type(exc).__name__)
        super().release()
        self.led.clear()
        self._led_changed()


def index_warning(db: store.Store, lanes: int, problem: str) -> str:
    """What a member without a serving lanes index for its count does, why, and how to build it."""
    table = db.names.table
    index, function = db_names.lanes_index(table, lanes), db_names.lanes_function(table, lanes)
    return (
        f"{db.names.qualified}: the lanes index and function for lanes = {lanes} ({index}, "
        f"{function}) do not serve: {problem}; each member walks every lane's due rows to find its "
        "own; `drain migrate` with this lanes setting builds them (CONCURRENTLY)"
    )


def leadership_for(
    db: store.Store,
    settings: config.Settings,
    clock: Callable[[], float] = time.monotonic,
    metrics_: metrics.Metrics | None = None,
) -> leadership.Leadership:
    """One lane (the setting ``lanes``): the leader lock (drain.relay.leadership); more:
    :class:`Lanes`, balancing every ``standby_retry_s`` and reporting the lanes it leads to
    ``metrics_``."""
    if settings.lanes <= 1:
        return leadership.Leadership(db)
    return Lanes(db, settings.lanes, balance_every_s=settings.standby_retry_s, clock=clock, metrics_=metrics_)


# --- what an operator sees: who leads which lane, each lane's backlog -------------------------


@dataclasses.dataclass(frozen=True)
class LaneFigures:
    """One lane's due rows: how many (among those the count walked) and the age of the oldest
    (as the table's lag counts it; 0 without one)."""

    lane: int
    due: int
    oldest_due_age_s: float


@dataclasses.dataclass(frozen=True)
class Backlog:
    """Every lane's figures (lane 0 to the count, in order), and whether a branch of the walk
    reached its cap (``capped``: the counts are of the rows walked, the oldest of each branch)."""

    lanes: tuple[LaneFigures, ...]
    capped: bool


def backlog(db: store.Store, lane_count: int, cap: int | None) -> Backlog:
    """Each lane's due rows, in one grouped statement (queries.sql lane_backlog), each branch of
    the walk stopped after ``cap`` rows (None: every due row)."""
    found = {int(row["lane"]): row for row in db.lane_backlog(lane_count, cap)}
    deferred = sum(int(row["deferred"]) for row in found.values())
    staged_now = sum(int(row["due"]) for row in found.values()) - deferred
    return Backlog(
        tuple(
            LaneFigures(lane, int(found[lane]["due"]), round(float(found[lane]["oldest_due_age_s"]), 3))
            if lane in found
            else LaneFigures(lane, 0, 0.0)
            for lane in range(lane_count)
        ),
        capped=cap is not None and max(deferred, staged_now) >= cap,
    )


def figures(db: store.Store, leading: leadership.Leadership) -> dict[str, Any]:
    """The table's figures a leading drain exports (Store.status, capped: metrics.COUNT_CAP).
    With lanes, lane 0's leader adds each lane's (``lanes``: :func:`backlog`, as capped): one
    grouped statement a refresh for the whole table, however many members."""
    found = db.status(metrics.COUNT_CAP, key_cap=metrics.KEY_COUNT_CAP)
    if isinstance(leading, Lanes) and leading.leads_schedules:
        found["lanes"] = backlog(db, leading.lanes, metrics.COUNT_CAP).lanes
    return found


@dataclasses.dataclass(frozen=True)
class Member:
    """A session holding locks in a table's lane key space: a member and the lanes it leads."""

    backend_pid: int
    application_name: str | None
    client_addr: str | None
    backend_start: datetime.datetime | None
    lanes: int | None
    """The lane count it runs with (None: it holds a lane and no member's lock, a moment's state)."""
    led: tuple[int, ...]


def members(db: store.Store) -> list[Member]:
    """Every member of the table's lanes and every lane's leader, by backend (one statement:
    Store.lane_sessions), in backend order."""
    found: dict[int, dict[str, Any]] = {}
    for row in db.lane_sessions(lane_space(db.settings.schema, db.settings.table)):
        entry = found.setdefault(int(row["pid"]), {"row": row, "lanes": None, "led": []})
        lane = int(row["lane"])
        if row["shared"] and lane >= MEMBERS:
            entry["lanes"] = lane - MEMBERS
        elif not row["shared"] and lane < MEMBERS:
            entry["led"].append(lane)
    return [
        Member(
            backend_pid=pid,
            application_name=entry["row"]["application_name"],
            client_addr=entry["row"]["client_addr"],
            backend_start=entry["row"]["backend_start"],
            lanes=entry["lanes"],
            led=tuple(sorted(entry["led"])),
        )
        for pid, entry in sorted(found.items())
    ]


def lane_count(configured: int, found: Sequence[Member]) -> int:
    """The lane count an operator's view splits the table by: the configured one when above 1;
    else the largest count a member runs with (a `drain status` run without the drains' setting);
    else 1, no lanes."""
    if configured > 1:
        return configured
    return max((member.lanes or 1 for member in found), default=1)

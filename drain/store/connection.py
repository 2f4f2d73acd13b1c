"""The drain's database sessions: how they connect, and the timeouts and keepalives they keep.

A leader's session is fenced by the server as well as by the drain: ``idle_session_timeout``
ends a frozen leader's session (and with it the lock), ``idle_in_transaction_session_timeout``
a hung publish's. :func:`connect` sets them after connecting and reads them back, because a
pooler may drop a startup parameter without a word.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg import conninfo

from drain import errors
from drain.config import settings as config
from drain.observability import redaction
from drain.store import identity, sql

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
KEEPALIVES_IDLE_S = 5
KEEPALIVES_INTERVAL_S = 2
KEEPALIVES_COUNT = 3
TCP_USER_TIMEOUT_MS = 10_000
MULTI_HOST_SESSION_ATTRS = "read-write"  # for several hosts, when nothing says otherwise
STANDBY_JITTER_MAX = 1.5  # a standby's wait is standby_retry_s jittered up to this (drain.relay.loop)
IDLE_SESSION_MARGIN_S = 10.0
"""Beyond its longest wait, how long the drain's session may be silent before the server ends it:
a turn's own work, and a second session connecting while the lock is taken (connect_timeout)."""
SETTLEMENT_RETRY_MAX_S = 10.0
"""The longest a leader waits before it writes a failed settlement again (drain.relay.settling
backs off up to it): one of the silences the session's ``idle_session_timeout`` must outlast."""
READY_CONNECT_TIMEOUT_S = 2  # the readiness probe's connect_timeout (database_probe)
NO_NAMES = sql.Names("public", "unused")  # for the statements that name no table
_VERSION_TIMEOUTS = ("idle_session_timeout", "transaction_timeout")  # absent before PG 14 / 17


def idle_in_transaction_timeout_ms(publish_timeout_s: float) -> int:
    """The server-side fence for a hung publish: well above the publish deadline.

    If a publish outlives it, Postgres ends the session, which releases the lock and makes the
    batch's delete impossible: the rows are published again by the next leader (a duplicate,
    never a loss).
    """
    return int(config.batch_fence_s(publish_timeout_s) * 1000)


def longest_silence_s(settings: config.Settings) -> float:
    """The longest the drain's session legitimately goes without a statement outside a
    transaction: the idle leader's poll (``poll_max_s``; ``wakeup_poll_max_s`` while the wake-up
    is armed), a standby's wait for the lock, a leader's wait to write a failed settlement again."""
    waits = [settings.poll_max_s, settings.standby_retry_s * STANDBY_JITTER_MAX, SETTLEMENT_RETRY_MAX_S]
    if settings.wakeup == config.WAKEUP_NOTIFY:
        waits.append(settings.wakeup_poll_max_s)
    return max(waits)


def idle_session_timeout_ms(settings: config.Settings) -> int:
    """The server-side fence for a frozen leader between batches: its longest silence plus
    IDLE_SESSION_MARGIN_S (20 s by default).

    A leader stopped (SIGSTOP, a hung VM, a wedged process) while its session idles holds the
    lock until the session ends; with this as its ``idle_session_timeout`` (PostgreSQL 14+), the
    server ends it and a standby leads. A healthy drain always speaks sooner.
    """
    return int((longest_silence_s(settings) + IDLE_SESSION_MARGIN_S) * 1000)


def listed_hosts(params: Mapping[str, Any], env: Mapping[str, str]) -> int:
    """How many hosts libpq tries for these DSN parameters, with ``PGHOST`` / ``PGHOSTADDR``
    where the DSN names none (as psycopg splits them into attempts); 0 when neither does."""
    counts = [0]
    for key, variable in (("host", "PGHOST"), ("hostaddr", "PGHOSTADDR")):
        value = params[key] if key in params else env.get(variable)
        if value:
            counts.append(len(str(value).split(",")))
    return max(counts)


def _session_attrs_set(params: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    return "target_session_attrs" in params or bool(env.get("PGTARGETSESSIONATTRS"))


def connection_kwargs(settings: config.Settings, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """libpq parameters for the drain's session; a parameter set in the DSN wins.

    The timeouts are not among them: :func:`connect` SETs them after connecting and reads them
    back, because a pooler may drop a startup ``options`` parameter without a word.

    Several hosts — in the DSN, or in ``PGHOST`` / ``PGHOSTADDR`` (``env``, default: the
    process's) when the DSN names none — get ``target_session_attrs=read-write`` unless the DSN
    or ``PGTARGETSESSIONATTRS`` sets it: libpq then skips a standby (or a read-only server) and
    connects to the host that can settle, wherever it is in the list; a drain on a standby would
    only stand by there (drain.relay.settling). One host is connected to as it is, so a drain given a
    standby stands by there and says why. (Hosts from a service file: :func:`connect`.)
    """
    env = os.environ if env is None else env
    present = conninfo.conninfo_to_dict(settings.dsn) if settings.dsn else {}
    wanted: dict[str, Any] = {
        "application_name": identity.application_name(),
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE_S,
        "keepalives_interval": KEEPALIVES_INTERVAL_S,
        "keepalives_count": KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
    }
    if listed_hosts(present, env) > 1 and not _session_attrs_set(present, env):
        wanted["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
    if env.get("PGAPPNAME"):
        del wanted["application_name"]  # the operator's name for these sessions
    return {key: value for key, value in wanted.items() if key not in present}


def session_timeouts_ms(settings: config.Settings) -> dict[str, int]:
    """The timeouts the drain's session must run with, in milliseconds (0: off).

    ``idle_session_timeout`` (PostgreSQL 14+) is :func:`idle_session_timeout_ms`, whatever a role
    or database sets: shorter, it would end the idle leader's session between batches and with
    it the lock; off, a frozen leader would keep the lock forever. ``transaction_timeout`` (17+)
    is off: a role's would end a long term. A server without one of them is checked for the
    others only.
    """
    return {
        "statement_timeout": int(settings.statement_timeout_s * 1000),
        "idle_timeout": idle_in_transaction_timeout_ms(settings.publish_timeout_s),
        "idle_session_timeout": idle_session_timeout_ms(settings),
        "transaction_timeout": 0,
    }


def _server_keepalives() -> dict[str, str]:
    """The server's side of the socket, as the drain's libpq side (set_timeouts)."""
    return {
        "keepalives_idle": str(KEEPALIVES_IDLE_S),
        "keepalives_interval": str(KEEPALIVES_INTERVAL_S),
        "keepalives_count": str(KEEPALIVES_COUNT),
        "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
    }


def connect(settings: config.Settings, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """Open a session with the drain's keepalives and timeouts, the timeouts verified.

    Raises DrainError with a one-line reason (password redacted) when it cannot connect or the
    session does not keep the timeouts it was given.
    """
    where = redaction.redact(settings.dsn) or "(libpq defaults)"  # also a DSN urllib cannot parse
    try:
        kwargs = connection_kwargs(settings)  # parses the DSN: a malformed one raises here
        conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
        if "target_session_attrs" not in kwargs and _standby_of_several(conn, settings.dsn):
            conn.close()  # hosts from a service file: libpq picks the writable one on request
            kwargs["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
            conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:  # a malformed DSN: libpq quotes it
        reason = redaction.redact(errors.first_line(exc))
        raise errors.DrainError(f"cannot connect to the database {where}: {reason}") from None
    try:
        wanted = session_timeouts_ms(settings)
        values = {key: str(value) for key, value in wanted.items()}
        conn.execute(sql.query("set_timeouts", NO_NAMES), {**values, **_server_keepalives()})
        if conn.info.encoding == "ascii":  # client_encoding SQL_ASCII: psycopg would load text as bytes
            _load_text_as_utf8(conn)
        row = conn.execute(sql.query("session_timeouts", NO_NAMES)).fetchone()
        got = dict(zip(("statement_timeout", "idle_timeout", *_VERSION_TIMEOUTS), row or (), strict=False))
        for name in _VERSION_TIMEOUTS:
            if got.get(name, 0) is None:  # this server has no such setting: nothing to keep
                del got[name], wanted[name]
        if got != wanted:
            raise errors.DrainError(
                f"the database session at {where} did not keep its timeouts (wanted {wanted} ms, "
                f"got {got} ms): is a pooler resetting session settings?"
            )
        conn.autocommit = autocommit
    except BaseException:
        conn.close()
        raise
    return conn


def _standby_of_several(conn: psycopg.Connection[Any], dsn: str) -> bool:
    """Whether libpq connected to a standby or a read-only server out of several hosts that no
    DSN, ``PG*`` variable or connection_kwargs counted: a service file's (``service=`` or
    ``PGSERVICE``), which only libpq reads. Then, as for any list of hosts, nothing set
    ``target_session_attrs`` (the service file may: then it is not ``any``)."""
    params = conninfo.conninfo_to_dict(dsn) if dsn else {}
    if _session_attrs_set(params, os.environ):
        return False
    used = {option.keyword.decode(): option.val.decode() for option in conn.pgconn.info if option.val}
    if used.get("target_session_attrs", "any") != "any" or listed_hosts(used, {}) < 2:
        return False
    standby = conn.info.parameter_status("in_hot_standby")  # reported by PostgreSQL 14+
    read_only = conn.info.parameter_status("default_transaction_read_only")
    return standby != "off" or read_only != "off"  # unknown (older servers): let libpq check


class _Utf8TextLoader(psycopg.adapt.Loader):
    """Text as str on a SQL_ASCII session, where psycopg hands it over as bytes: UTF-8 (names,
    channels, error texts the drain wrote), and as bytes only when it is not UTF-8 — which
    drain.store.decoding then refuses for a staged row, as it always did."""

    def load(self, data: Any) -> str | bytes:
        raw = bytes(data)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw


class LenientTextLoader(psycopg.adapt.Loader):
    """Text as str whatever its bytes (shown by the CLI: a dead letter's names may not be UTF-8)."""

    def load(self, data: Any) -> str:
        return bytes(data).decode("utf-8", "replace")


TEXT_TYPES = ("text", "varchar", "bpchar", "name", '"char"')


def _load_text_as_utf8(conn: psycopg.Connection[Any]) -> None:
    for name in TEXT_TYPES:
        conn.adapters.register_loader(name, _Utf8TextLoader)
    conn.adapters.register_loader(0, _Utf8TextLoader)  # unknown: a literal's type


def split_key(key: int) -> tuple[int, int]:
    """The (classid, objid) under which pg_locks shows a bigint advisory lock key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def database_probe(settings: config.Settings) -> Callable[[], str | None]:
    """A readiness probe (drain.observability.server): a fresh connection with the drain's
    parameters (connect_timeout READY_CONNECT_TIMEOUT_S) runs ``ping``; None when it answers,
    else a short reason."""

    def probe() -> str | None:
        try:
            kwargs = connection_kwargs(settings)
            kwargs["connect_timeout"] = READY_CONNECT_TIMEOUT_S
            with psycopg.connect(settings.dsn, autocommit=True, **kwargs) as conn:
                conn.execute(sql.query("ping", NO_NAMES))
        except psycopg.Error as exc:
            log.debug("readiness probe failed: %s", type(exc).__name__)
            return "database unreachable"
        return None

    return probe


def lock_held_elsewhere(settings: config.Settings, names: sql.Names, key: int) -> tuple[bool, int]:
    """Run the lock_held check on a second, brand-new session: (held there, its backend pid).

    Directly or through a session pool, that session is another backend and does not hold
    our lock. A transaction pool hands out idle server connections last-in first-out, so it
    gives this probe the very backend our last statement ran on: the one holding the lock.
    The probe then unlocks it there, or the pool would keep it orphaned on that backend.
    """
    classid, objid = split_key(key)
    with connect(settings) as probe:
        row = probe.execute(
            sql.query("lock_held", names), {"classid": classid, "objid": objid, "relaxed": False}
        ).fetchone()
        assert row is not None
        if row[1]:
            probe.execute(sql.query("unlock", names), {"key": key})
    return bool(row[1]), int(row[0])

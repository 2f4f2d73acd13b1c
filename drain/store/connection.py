"""The drain's database sessions: how they connect, and the timeouts and keepalives they keep.

The server fences a leader's session as well as the drain does. ``idle_session_timeout`` ends
a frozen leader's session, and the lock with it; ``idle_in_transaction_session_timeout`` a hung
publish's. :func:`connect` sets them, then reads them back: a pooler may drop a startup
parameter without a word.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from drain import errors
from drain.config import parsing
from drain.config import settings as config
from drain.observability import redaction
from drain.store import identity, sql

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
KEEPALIVES = {
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
"""TCP keepalives (seconds) and the user timeout (ms), on the drain's side and the server's."""
MULTI_HOST_SESSION_ATTRS = "read-write"  # for several hosts, when nothing says otherwise
STANDBY_JITTER_MAX = 1.5  # a standby's wait is standby_retry_s jittered up to this (drain.relay.pacing)
IDLE_SESSION_MARGIN_S = 10.0
"""Beyond its longest wait, how long the session may be silent before the server ends it: a
turn's own work, and a second session connecting while the lock is taken."""
SETTLEMENT_RETRY_MAX_S = 10.0
"""The longest a leader waits before it writes a failed settlement again: one of the silences
the session's ``idle_session_timeout`` must outlast."""
READY_CONNECT_TIMEOUT_S = 2  # the readiness probe's connect_timeout (database_probe)
NO_NAMES = sql.Names("public", "unused")  # for the statements that name no table
_VERSION_TIMEOUTS = ("idle_session_timeout", "transaction_timeout")  # absent before PG 14 / 17


def idle_in_transaction_timeout_ms(publish_timeout_s: float) -> int:
    """The server-side fence for a hung publish, well above the publish deadline. Past it the
    session ends, and the lock with it: the next leader publishes the rows again (a duplicate,
    never a loss)."""
    return int(config.batch_fence_s(publish_timeout_s) * 1000)


def longest_silence_s(settings: config.Settings) -> float:
    """The longest the session may go without a statement outside a transaction: the idle
    poll (armed or not), a standby's wait, a failed settlement's wait."""
    waits = [settings.poll_max_s, settings.standby_retry_s * STANDBY_JITTER_MAX, SETTLEMENT_RETRY_MAX_S]
    if settings.wakeup == config.WAKEUP_NOTIFY:
        waits.append(settings.wakeup_poll_max_s)
    return max(waits)


def idle_session_timeout_ms(settings: config.Settings) -> int:
    """The server-side fence for a frozen leader between batches: its longest silence plus
    IDLE_SESSION_MARGIN_S. A stopped leader (SIGSTOP, a hung VM) holds the lock until its session
    ends; the server then ends it and a standby leads. A healthy drain always speaks sooner."""
    return int((longest_silence_s(settings) + IDLE_SESSION_MARGIN_S) * 1000)


def listed_hosts(params: Mapping[str, Any], env: Mapping[str, str]) -> int:
    """How many hosts libpq tries for these DSN parameters, or ``PGHOST`` / ``PGHOSTADDR``
    where the DSN names none; 0 when neither does."""
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

    - The timeouts are not among them: :func:`connect` sets them and reads them back.
    - Several hosts (DSN, or ``PGHOST`` / ``PGHOSTADDR`` in ``env``) get
      ``target_session_attrs=read-write`` unless something sets it. libpq then skips a standby
      and connects to the host that can settle, wherever it is in the list.
    - One host is connected to as it is: a drain given a standby stands by and says why.
    - Hosts from a service file: :func:`connect`.
    """
    env = os.environ if env is None else env
    present = parsing.dsn_params(settings.dsn)
    wanted: dict[str, Any] = {
        "application_name": identity.application_name(),
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        **KEEPALIVES,
    }
    if listed_hosts(present, env) > 1 and not _session_attrs_set(present, env):
        wanted["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
    if env.get("PGAPPNAME"):
        del wanted["application_name"]  # the operator's name for these sessions
    return {key: value for key, value in wanted.items() if key not in present}


def session_timeouts_ms(settings: config.Settings) -> dict[str, int]:
    """The timeouts the drain's session must run with, in milliseconds (0: off).

    - ``idle_session_timeout`` (PostgreSQL 14+) overrides a role's: shorter, it would end an idle
      leader's session; off, a frozen leader would keep the lock forever.
    - ``transaction_timeout`` (17+) is off: a role's would end a long term.
    """
    return {
        "statement_timeout": int(settings.statement_timeout_s * 1000),
        "idle_timeout": idle_in_transaction_timeout_ms(settings.publish_timeout_s),
        "idle_session_timeout": idle_session_timeout_ms(settings),
        "transaction_timeout": 0,
    }


def connect(settings: config.Settings, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """Open a session with the drain's keepalives and timeouts, the timeouts verified.

    - ConfigError: libpq cannot parse the DSN (the message quotes none of it).
    - DrainError, one line: it cannot connect, or the session drops its timeouts.
    - Neither shows a piece of the password. libpq may read one as a host, a user or a
      database, so its reason is redacted of every fragment (redaction.fragments).
    """
    secrets = redaction.fragments(settings.dsn)
    where = redaction.redact(redaction.redact_url(settings.dsn), secrets) or "(libpq defaults)"
    kwargs = connection_kwargs(settings)  # parses the DSN: ConfigError for a malformed one
    try:
        conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
        if "target_session_attrs" not in kwargs and _standby_of_several(conn, settings.dsn):
            conn.close()  # hosts from a service file: libpq picks the writable one on request
            kwargs["target_session_attrs"] = MULTI_HOST_SESSION_ATTRS
            conn = psycopg.connect(settings.dsn, autocommit=True, **kwargs)
    except psycopg.Error as exc:
        reason = redaction.redact(errors.first_line(exc), secrets)
        raise errors.DrainError(f"cannot connect to the database {where}: {reason}") from None
    try:
        wanted = session_timeouts_ms(settings)
        values = {key: str(value) for key, value in {**wanted, **KEEPALIVES}.items()}
        conn.execute(sql.query("set_timeouts", NO_NAMES), values)
        if conn.info.encoding == "ascii":  # client_encoding SQL_ASCII: psycopg would load text as bytes
            for name in (*TEXT_TYPES, 0):  # 0, unknown: a literal's type
                conn.adapters.register_loader(name, _Utf8TextLoader)
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
    """Whether libpq connected to a standby or a read-only server among several hosts only it
    read (a service file's), with no ``target_session_attrs`` set anywhere."""
    params = parsing.dsn_params(dsn)
    if _session_attrs_set(params, os.environ):
        return False
    used = {option.keyword.decode(): option.val.decode() for option in conn.pgconn.info if option.val}
    if used.get("target_session_attrs", "any") != "any" or listed_hosts(used, {}) < 2:
        return False
    standby = conn.info.parameter_status("in_hot_standby")  # reported by PostgreSQL 14+
    read_only = conn.info.parameter_status("default_transaction_read_only")
    return standby != "off" or read_only != "off"  # unknown (older servers): let libpq check


class _Utf8TextLoader(psycopg.adapt.Loader):
    """Text on a SQL_ASCII session, which psycopg hands over as bytes: str when it is UTF-8.
    Bytes otherwise, which drain.store.reading refuses in a staged row."""

    def load(self, data: Any) -> str | bytes:
        raw = bytes(data)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw


TEXT_TYPES = ("text", "varchar", "bpchar", "name", '"char"')


def split_key(key: int) -> tuple[int, int]:
    """The (classid, objid) under which pg_locks shows a bigint advisory lock key."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def database_probe(settings: config.Settings) -> Callable[[], str | None]:
    """A readiness probe: a fresh connection runs ``ping``; None when it answers, else a short
    reason."""

    def probe() -> str | None:
        try:
            kwargs = connection_kwargs(settings)
            kwargs["connect_timeout"] = READY_CONNECT_TIMEOUT_S
            with psycopg.connect(settings.dsn, autocommit=True, **kwargs) as conn:
                conn.execute(sql.query("ping", NO_NAMES))
        except (psycopg.Error, errors.DrainError) as exc:
            log.debug("readiness probe failed: %s", type(exc).__name__)
            return "database unreachable"
        return None

    return probe

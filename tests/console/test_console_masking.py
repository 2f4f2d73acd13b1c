"""What the console masks in the arguments, and that its arguments filter searches exactly that:
a secret's name however its words are separated (Postgres picks the rows Python must decide),
keys masked as values are, and two keys masked alike both shown."""

from __future__ import annotations

import psycopg
import pytest

from drain.observability import redaction
from drain.store import admin
from drain.store import session as store
from tests.support import console

pytest.importorskip("drain.console.app")
from drain.console import text

NEEDLE = "zq7needle"


def _bury_kwargs(db: store.Store, kwargs: object) -> None:
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(db.settings.dsn, [{"job_name": "mail.send", "kwargs": kwargs}])


def _found(db: store.Store, term: str) -> int:
    walk = admin.Admin(db.conn, db.names).dead_matching(admin.DeadFilter(limit=100, arg=term), 1_000, 20_000)
    return walk.matching


def _shown(db: store.Store) -> str:
    (row,) = admin.Admin(db.conn, db.names).dead_list(admin.DeadFilter())
    return text.pretty(row["job_kwargs"])


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("pa_ss", id="underscore-inside-a-word"),
        pytest.param("Api Key", id="space"),
        pytest.param("x.api-key", id="dots-and-dashes"),
        pytest.param("pa\nss", id="newline: an escape in the JSON text"),
        pytest.param('se"cret', id="quote: an escape in the JSON text"),
        pytest.param("to\u200bken", id="zero-width space"),
        pytest.param("pa\u017f_s", id="long s"),
    ],
)
def test_a_secret_name_however_separated_is_masked_and_not_searched(db: store.Store, key: str) -> None:
    """Python drops all but letters and digits before it looks for a secret's word; Postgres, which
    decides the rows no masking can touch, must send each such row to Python, or its filter would
    search the value the page masks."""
    assert redaction.is_secret_name(key)
    _bury_kwargs(db, {key: NEEDLE})
    assert NEEDLE not in _shown(db)
    assert _found(db, NEEDLE) == 0


@pytest.mark.parametrize("key", ["ordering_key", "keyboard", "key", "monkey", "tls_key_file"])
def test_a_key_that_names_no_secret_is_shown_and_searched(db: store.Store, key: str) -> None:
    assert not redaction.is_secret_name(key)
    _bury_kwargs(db, {key: NEEDLE})
    assert NEEDLE in _shown(db)
    assert _found(db, NEEDLE) == 1


def test_two_keys_masked_alike_are_both_shown_and_found(db: store.Store) -> None:
    """Two replicas' URLs, the same but for their passwords: each keeps its entry (the second one
    ``*`` more), and the filter finds what the page shows of them."""
    _bury_kwargs(db, {"postgresql://app:first1@r1/db": "down", "postgresql://app:second2@r1/db": NEEDLE})
    shown = _shown(db)
    assert '"postgresql://app:***@r1/db": "down"' in shown
    assert f'"postgresql://app:***@r1/db*": "{NEEDLE}"' in shown
    assert "first1" not in shown and "second2" not in shown
    assert _found(db, NEEDLE) == 1
    assert _found(db, "r1/db*") == 1
    assert _found(db, "second") == 0


def test_the_list_cut_shows_no_prefix_of_an_own_secret_its_masks_brought_forward(db: store.Store) -> None:
    """Each ``***`` is shorter than the secret it hides, so the list's first 200 characters, once
    redacted, may hold text that stood far beyond them: an own secret there, read only in part,
    would show its first characters."""
    secret = "Sup3rDbPassw0rd"
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM staged_jobs_dead")
    console.bury(db.settings.dsn, [{"error": secret * 13 + "y" * 10 + secret + " end"}])
    redaction.hide([secret])
    try:
        (row,) = admin.Admin(db.conn, db.names).dead_page(admin.DeadFilter(limit=1), 200, 4096)
    finally:
        redaction.hide(())
    assert row["error"] == "***" * 13 + "y" * 10 + "*** end"

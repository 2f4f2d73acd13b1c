"""What the console's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from drain import config
from drain.store import session as store


@pytest.fixture
def db(database: str) -> Iterator[store.Store]:
    """A Store on the test's database (its admin queries: ``admin.Admin(db.conn, db.names)``)."""
    opened = store.Store(config.Settings(dsn=database))
    try:
        yield opened
    finally:
        opened.close()

"""drain.store.identity: the application name every drain session carries, and reading it back."""

from __future__ import annotations

import datetime

from hypothesis import given
from hypothesis import strategies as st

from drain.store import identity


def test_a_name_names_version_process_host_and_since() -> None:
    name = identity.compose("0.2.0", 4242, "worker-3", leading_since=1764000000.7)
    assert name == "drain/0.2.0 4242@worker-3 L1764000000"
    assert identity.parse(name) == identity.Drain(
        "0.2.0", 4242, "worker-3", datetime.datetime.fromtimestamp(1764000000, datetime.UTC)
    )
    assert identity.parse(identity.compose("0.2.0", 7, "h")) == identity.Drain("0.2.0", 7, "h")


@given(host=st.text(max_size=300), pid=st.integers(0, 2**22), since=st.none() | st.floats(0, 2**33))
def test_any_host_fits_63_ascii_bytes_and_reads_back(host: str, pid: int, since: float | None) -> None:
    name = identity.compose("0.2.0", pid, host, leading_since=since)
    assert name.isascii() and len(name) <= identity.MAX_BYTES
    found = identity.parse(name)
    assert found is not None and found.pid == pid
    assert (
        found.host
        == "".join(c if c.isascii() and c.isprintable() and not c.isspace() else "?" for c in host)[
            : len(found.host)
        ]
    )
    assert (found.since is None) == (since is None)


def test_other_clients_are_not_drains() -> None:
    for other in (None, "", "drain", "psql", "drain/0.2.0", "drain/0.2.0 x@h"):
        assert identity.parse(other) is None

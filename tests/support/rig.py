"""An end-to-end rig: the test's database with the ledger tables, a drain config, RQ workers; and
the in-process relay over the in-memory backend. Fixtures of every folder (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from drain import config, testing
from drain.relay import loop as relay
from tests.support import configs, ledger, processes, relays
from tests.support.load import Load, LoadResult

if TYPE_CHECKING:
    from tests.conftest import ManualClock


@dataclasses.dataclass
class Rig:
    dsn: str
    redis_url: str
    queue: str
    config: Path
    tmp: Path
    workers: list[processes.Process]

    def start_drain(self, name: str = "drain", *args: str) -> processes.Process:
        return processes.start_drain(self.config, self.dsn, self.tmp / f"{name}.log", *args)

    def config_for(self, name: str) -> Path:
        """A config whose Postgres session is named ``name`` (to tell drains apart in pg_stat_activity)."""
        return configs.write_config(
            self.tmp / f"{name}.toml",
            processes.with_application_name(self.dsn, name),
            {"default": configs.rq(self.redis_url, processes.ALLOWED_JOBS)},
        )

    def finish(self, load: Load, name: str) -> tuple[LoadResult, ledger.Tally]:
        """Wait for the load to end, then let a fresh drain ``name`` forward everything it committed."""
        result = load.join()
        drain = self.start_drain(name)
        with processes.running(drain):
            return result, ledger.wait_drained(self.dsn, len(result.committed))

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )


@pytest.fixture
def rig(database: str, redis_db: str, tmp_path: Path) -> Iterator[Rig]:
    """Ledger tables, a drain.toml for an RQ backend on the test's Redis db, and 3 running workers."""
    ledger.install(database)
    queue = f"drain-test-{uuid.uuid4().hex[:8]}"
    config = configs.write_config(
        tmp_path / "drain.toml", database, {"default": configs.rq(redis_db, processes.ALLOWED_JOBS)}
    )
    workers = processes.start_workers(redis_db, queue, database, tmp_path, count=3)
    with processes.running(*workers):
        yield Rig(database, redis_db, queue, config, tmp_path, workers)


@pytest.fixture
def memory() -> testing.MemoryAdapter:
    return testing.MemoryAdapter("default")


@pytest.fixture
def leader(
    settings: config.Settings, memory: testing.MemoryAdapter, clock: ManualClock
) -> Iterator[relay.Relay]:
    """A relay over the ``memory`` backend that already leads (batch_size 100)."""
    the_relay = relays.leading(settings, {"default": memory}, clock)
    yield the_relay
    the_relay.shutdown()

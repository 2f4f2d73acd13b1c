"""The console under test: dead letters written straight into the table, a real ``drain console``
process on a free loopback port, and a small HTTP client with its own cookies."""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from tests import conftest
from tests.support import faultload, processes
from tests.support.waiting import wait_until

TOKEN = "a-test-admin-token-0123456789"


def bury(dsn: str, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Write dead letters (job_name, args, kwargs, queue, backend, error, ordering_key, dead_at:
    each optional) into the dead-letter table; their dead_ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = []
        for number, row in enumerate(rows):
            found = conn.execute(
                "INSERT INTO staged_jobs_dead (id, job_name, job_args, job_kwargs, queue, backend, job_id,"
                " options, created_at, attempts, error, ordering_key, dead_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, now(), 3, %s, %s, coalesce(%s, now()))"
                " RETURNING dead_id",
                (
                    1_000_000 + number,
                    row.get("job_name", "tasks.send"),
                    json.dumps(row.get("args", [number])),
                    json.dumps(row.get("kwargs", {})),
                    row.get("queue", "default"),
                    row.get("backend", "default"),
                    uuid.uuid4(),
                    json.dumps(row.get("options", {})),
                    row.get("error", "boom"),
                    row.get("ordering_key"),
                    row.get("dead_at"),
                ),
            ).fetchone()
            assert found is not None
            ids.append(int(found[0]))
    return ids


def count(dsn: str, table: str = "staged_jobs_dead") -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


@contextlib.contextmanager
def running(dsn: str, tmp: Path, *, token: str | None = TOKEN, args: Sequence[str] = ()) -> Iterator[Console]:
    """``drain console`` on ``dsn`` (the admin token ``token``; None: read-only), until the block ends."""
    port = faultload.free_port()
    env = {"DRAIN_CONSOLE_TOKEN": token} if token is not None else {}
    process = processes.Process(
        [processes.DRAIN, "console", "--dsn", dsn, "--port", str(port), *args],
        processes.environment(None, env),
        tmp / f"console-{port}.log",
    )
    with processes.running(process):
        wait_until(
            "the console to listen",
            lambda: conftest.port_open("127.0.0.1", port) or not process.alive(),
            30,
        )
        assert process.alive(), process.output()
        yield Console(f"http://127.0.0.1:{port}", process)


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: str


class Console:
    """One running console (its process, or None: served in the test) and a visitor of it
    (cookies kept, redirects followed)."""

    def __init__(self, url: str, process: processes.Process | None) -> None:
        self.url = url
        self.process = process
        self.cookies = http.cookiejar.CookieJar()
        self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> Reply:
        return self._send(urllib.request.Request(self.url + path, headers=dict(headers or {})))

    def post(self, path: str, form: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> Reply:
        return self.post_as(path, form, {})

    def post_as(
        self, path: str, form: Mapping[str, Any] | Sequence[tuple[str, Any]], headers: Mapping[str, str]
    ) -> Reply:
        data = urllib.parse.urlencode(form, doseq=True).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST", headers=dict(headers))
        return self._send(request)

    def _send(self, request: urllib.request.Request) -> Reply:
        try:
            with self._opener.open(request, timeout=120) as response:
                return Reply(response.status, dict(response.headers), response.read().decode())
        except urllib.error.HTTPError as error:
            return Reply(error.code, dict(error.headers), error.read().decode())

    def csrf(self, path: str = "/dead") -> str:
        """This visitor's CSRF token, read from a page's form."""
        body = self.get(path).body
        marker = 'name="csrf" value="'
        start = body.index(marker) + len(marker)
        return body[start : body.index('"', start)]

    def sign_in(self, token: str = TOKEN, name: str = "ops") -> Reply:
        return self.post("/login", {"csrf": self.csrf("/login"), "token": token, "name": name})

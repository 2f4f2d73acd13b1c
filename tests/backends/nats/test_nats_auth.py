"""Logins, TLS and whole-server refusals of the NATS backend, on private nats-server processes
(free loopback ports, their own store directories, stopped by PID).

- TLS with the server's CA, user/password and an NKey seed file publish; a wrong password, an
  unknown CA and a server without JetStream are outages (BackendUnavailable), and no password
  appears in an error or a log line.
- A permissions violation for one subject is the account's refusal: an outage, the row neither
  published nor rejected.
- A token login on a server that takes tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats as nats_client
import nkeys
import pytest
from drain_adapters import nats

from drain import errors, models
from tests import conftest
from tests.support import faultload, jobs
from tests.support.waiting import wait_until

PASSWORD = "s3cret-Pa55word"
TOKEN = "t0ken-Value-42"
STREAM = "AUTH"


@contextlib.contextmanager
def server(directory: Path, config: str, *, jetstream: bool = True) -> Iterator[int]:
    """A private nats-server with ``config`` (its listen and store added), on a free port."""
    binary = conftest.need_binary("nats-server", "nats-server")
    port = faultload.free_port()
    store = directory / f"store{port}"
    text = f"listen: 127.0.0.1:{port}\n" + (f'jetstream {{ store_dir: "{store}" }}\n' if jetstream else "")
    path = directory / f"server{port}.conf"
    path.write_text(text + config)
    process = subprocess.Popen(
        [binary, "-c", str(path), "-l", str(directory / f"server{port}.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until("the private nats-server", lambda: conftest.port_open("127.0.0.1", port), 30)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA) and its key."""
    cert, key = directory / "server.pem", directory / "server.key"
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    command += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    command += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
    )
    return cert, key


def adapter(port: int, scheme: str = "nats", **options: Any) -> nats.NatsAdapter:
    return nats.NatsAdapter.from_options(
        "auth",
        {"url": f"{scheme}://127.0.0.1:{port}", "subject_prefix": STREAM, "publish_timeout_s": 5, **options},
        publish_timeout_s=10,
    )


def create_stream(port: int, cert: Path) -> None:
    """The operator's stream, created with nats-py over TLS as user drain."""

    async def run() -> None:
        context = ssl.create_default_context(cafile=str(cert))
        client = await nats_client.connect(
            f"tls://127.0.0.1:{port}", user="drain", password=PASSWORD, tls=context, connect_timeout=5
        )
        try:
            await client.jetstream().add_stream(name=STREAM, subjects=[f"{STREAM}.>"])
        finally:
            await client.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path]]:
    """A server with TLS and three users: drain (all), limited (not STREAM.secret), an NKey."""
    directory = tmp_path_factory.mktemp("nats-auth")
    cert, key = certificate(directory)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    seed_file = directory / "drain.nk"
    seed_file.write_bytes(seed + b"\n")
    public = nkeys.from_seed(seed).public_key.decode()
    config = f"""
tls {{ cert_file: "{cert}", key_file: "{key}" }}
authorization {{
  users = [
    {{ user: drain, password: "{PASSWORD}" }}
    {{ user: limited, password: "{PASSWORD}", permissions: {{ publish: {{ deny: ["{STREAM}.secret"] }} }} }}
    {{ nkey: {public} }}
  ]
}}
"""
    with server(directory, config) as port:
        create_stream(port, cert)
        yield port, cert, seed_file


def publish_one(built: nats.NatsAdapter, queue: str = "work") -> list[models.PublishResult]:
    built.open()
    try:
        return list(built.publish_batch([jobs.staged(1, queue)]))
    finally:
        built.close()


def test_tls_with_a_password_or_an_nkey_publishes(secured: tuple[int, Path, Path]) -> None:
    port, cert, seed_file = secured
    logins: list[dict[str, Any]] = [
        {"user": "drain", "password": PASSWORD},
        {"nkey_seed_file": str(seed_file)},
    ]
    for login in logins:
        results = publish_one(adapter(port, "tls", tls_ca_file=str(cert), **login))
        assert [result.outcome for result in results] == [models.Outcome.PUBLISHED], login


def test_refusals_of_the_whole_server_are_outages_and_never_show_a_password(
    secured: tuple[int, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    port, cert, _ = secured
    caplog.set_level(logging.DEBUG)
    cases = {
        "wrong password": adapter(port, tls_ca_file=str(cert), user="drain", password=PASSWORD + "x"),
        "unknown CA": adapter(port, "tls", user="drain", password=PASSWORD),
        "no login": adapter(port, tls_ca_file=str(cert)),
    }
    for case, built in cases.items():
        with pytest.raises(errors.BackendUnavailable) as raised:
            publish_one(built)
        assert PASSWORD not in str(raised.value), case
    assert PASSWORD not in caplog.text


def test_a_denied_subject_makes_its_rows_wait_not_the_rows_rejection(secured: tuple[int, Path, Path]) -> None:
    port, cert, _ = secured
    built = adapter(port, tls_ca_file=str(cert), user="limited", password=PASSWORD)
    [result] = publish_one(built, "secret")
    assert result.outcome is models.Outcome.RETRY and "denies publishing" in (result.error or ""), result
    assert [result.outcome for result in publish_one(built, "work")] == [models.Outcome.PUBLISHED]


def test_a_token_login_and_a_server_without_jetstream(tmp_path: Path) -> None:
    with server(tmp_path, f'authorization {{ token: "{TOKEN}" }}\n', jetstream=False) as port:
        with pytest.raises(errors.BackendUnavailable, match="JetStream is not enabled") as raised:
            adapter(port, token=TOKEN).open()  # the login works; JetStream does not answer
        assert TOKEN not in str(raised.value)
        with pytest.raises(errors.BackendUnavailable, match="Authorization Violation") as raised:
            adapter(port, token=TOKEN + "x").open()
        assert TOKEN not in str(raised.value)

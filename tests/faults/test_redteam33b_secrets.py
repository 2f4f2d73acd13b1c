"""Red team (issue 33, second pass): routes by which a password still reaches an output.

Finding: a RabbitMQ URL whose password holds a raw ``/`` (a password nobody percent-encoded:
``amqp://guest:Pa55w0rdS3cret/x@host/%2F``) is accepted by the settings, then
``pika.URLParameters`` in ``RabbitMQLink.__init__`` (adapters/drain_adapters/rabbitmq/link.py)
raises urllib's ``ValueError: Port could not be cast to integer value as 'Pa55w0rdS3cret'``.
Nothing catches it: ``drain check`` and ``drain run`` (text or JSON logs) die with Python's raw
traceback on stderr, written by the interpreter, never through drain's redaction, so the
password is printed in clear. The same for the Dramatiq backend on RabbitMQ. (Celery's
``broker_url`` is checked and says it in one redacted line.) Any other URL pika refuses
(``?heartbeat=abc``) gives the same raw traceback: "User mistakes print one line, never a
traceback" does not hold.

Expected: one line, exit 2 (configuration), no piece of the password. Observed: a traceback
with the whole password, exit 1.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from tests.support import configs, processes, rabbit

PASSWORD = "Pa55w0rdS3cret"


@pytest.mark.parametrize("kind", ["rabbitmq", "dramatiq"])
@pytest.mark.parametrize("command", [["check"], ["run", "--once"]])
def test_a_url_pika_refuses_prints_no_password_and_no_traceback(
    kind: str, command: list[str], tmp_path: Path
) -> None:
    config = tmp_path / "drain.toml"
    config.write_text(
        'dsn = "postgresql://postgres@127.0.0.1:5432/postgres"\n'
        "[backends.default]\n"
        f'type = "{kind}"\n'
        f'url = "amqp://guest:{PASSWORD}/x@127.0.0.1:5672/%2F"\n'
    )
    done = subprocess.run(
        [processes.DRAIN, *command, "--config", str(config)],
        env=processes.environment(None),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = done.stdout + done.stderr
    assert PASSWORD not in output, output
    assert "Traceback" not in output, output
    assert done.returncode == (3 if command == ["check"] else 2), output  # check: every problem, exit 3
    assert "node 1 is no URL pika can read" in output, output


def test_the_shown_dsn_masks_only_the_password() -> None:
    """Finding: ``redaction.hide`` masks every fragment of the password (each run of 4+ letters
    or digits) wherever it appears, so any word of the output that happens to be a piece of the
    password becomes ``***``. With the password ``xx-test-yy`` and the database ``test``,
    ``drain check --show-config`` prints ``postgresql://postgres:***@127.0.0.1:5432/***``: the
    reader learns that the password contains ``test`` (and the same holds for every log line, a
    host, a queue or a job name equal to a piece of the password: an oracle), and the operator
    no longer sees which database the drain uses. Expected: only the password's place masked.
    """
    env = processes.environment(None, {"DRAIN_DSN": "postgresql://postgres:xx-test-yy@127.0.0.1:5432/test"})
    done = subprocess.run(
        [processes.DRAIN, "check", "--show-config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    shown = [line for line in done.stdout.splitlines() if line.startswith("dsn = ")]
    assert shown, done.stdout + done.stderr
    assert shown[0].startswith('dsn = "postgresql://postgres:***@127.0.0.1:5432/test"'), shown[0]


def _dead_errors(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(row[0]) for row in conn.execute("SELECT last_error FROM staged_jobs_dead")]


def test_a_second_node_url_pika_refuses_logs_no_password(database: str, tmp_path: Path) -> None:
    """Finding: with ``url`` a list of a cluster's nodes, only the first URL is parsed by pika at
    start (``RabbitMQLink.__init__``). When the first node is down, ``open`` reaches the second,
    whose password holds a raw ``/``: ``pika.URLParameters`` raises urllib's ValueError quoting the
    password, and the relay's availability logs it on every retry ("backend default unavailable
    ...: cannot open: ValueError: Port could not be cast to integer value as '<password>'"). The
    redaction's hidden fragments do not cover it: ``cli._secrets`` takes only options that are a
    ``str`` with ``://``, and a list of URLs is not one. (Held: the rows wait, nothing is
    dead-lettered, no ``last_error`` holds the password.)
    Expected: no piece of the password in the log. Observed: the whole password, each retry.
    """
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {
            "default": {
                "type": "rabbitmq",
                "url": [
                    "amqp://guest:guest@127.0.0.1:1/%2F",  # the first node: down
                    f"amqp://guest:{PASSWORD}/x@127.0.0.1:5672/%2F",
                ],
            }
        },
        max_attempts=1,
    )
    rabbit.stage_jobs(database, 4, ("rt33a", "rt33b"), "default")
    drain = processes.start_drain(config, None, tmp_path / "drain.log")
    try:
        time.sleep(6)
    finally:
        drain.stop()
    stored = _dead_errors(database)
    log = drain.output()
    assert not any(PASSWORD in error for error in stored), stored
    assert PASSWORD not in log, log
    assert stored == [], stored

"""The test suite's one process runner: start and stop the real processes of an end-to-end test
(``drain run``, ``rq worker``, the ``drain`` CLI).

Everything runs from the project's venv (the interpreter running the tests), with the repository
root on PYTHONPATH so a worker can import ``tests.support.tasks``. Output goes to files in the
test's tmp_path (a pipe nobody reads would block the child). Processes are stopped by PID only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import tasks

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DRAIN = str(BIN / "drain")
RQ = str(BIN / "rq")
ALLOWED_JOBS = ["tests.support.tasks.record"]


def environment(dsn: str | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without DRAIN_*, PG* and DATABASE_URL; ``dsn`` for the test tasks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "PG"))}
    env.pop("DATABASE_URL", None)
    env["PYTHONPATH"] = str(ROOT)
    if dsn is not None:
        env[tasks.DSN_VARIABLE] = dsn
    env.update(extra or {})
    return env


def with_application_name(dsn: str, name: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"


class Process:
    """A child process with its output in a log file: a drain, a worker, any server of a test."""

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path, *, config: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_path = log
        self.config = config
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv, env=dict(env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 120.0) -> int:
        """The exit code, once it exits (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
        return self.popen.wait(timeout=timeout_s)

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP): state T in /proc."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in {"T", "t"}

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait for the exit code (SIGKILL after ``timeout_s``, and raise)."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=30)
            raise

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (after SIGCONT, in case it is frozen); SIGKILL if it does not exit in time."""
        self.signal(signal.SIGCONT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.terminate(timeout_s)
        return self.popen.returncode


def start_drain(
    config: Path,
    dsn: str | None,
    log: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    failpoints: str = "",
) -> Process:
    """``drain run --config config *args``; ``dsn`` is the database the test tasks record in
    (None: no worker of this test runs them), ``failpoints`` go to DRAIN_FAILPOINTS."""
    extra = {"DRAIN_FAILPOINTS": failpoints} if failpoints else {}
    return Process(
        [DRAIN, "run", "--config", str(config), *args],
        environment(dsn, {**extra, **(env or {})}),
        log,
        config=config,
    )


def start_workers(
    redis_url: str,
    queue: str,
    dsn: str,
    tmp: Path,
    count: int = 3,
    *,
    worker_class: str = "rq.worker.SimpleWorker",
    args: Sequence[str] = (),
) -> list[Process]:
    """``count`` workers on ``queue``: SimpleWorkers (no fork per job) unless ``worker_class``
    says otherwise; ``args`` go to ``rq worker`` (e.g. ``--job-class``)."""
    return [
        Process(
            [
                RQ,
                "worker",
                "--url",
                redis_url,
                "--worker-class",
                worker_class,
                *args,
                "--name",
                f"{queue}-{index}-{os.getpid()}",
                "--quiet",
                queue,
            ],
            environment(dsn),
            tmp / f"worker-{index}.log",
        )
        for index in range(count)
    ]


@contextlib.contextmanager
def running(*processes: Process) -> Iterator[tuple[Process, ...]]:
    """Stop (SIGCONT, SIGTERM, then SIGKILL) every process on the way out, whatever happens in
    the block."""
    try:
        yield processes
    finally:
        for process in processes:
            with contextlib.suppress(Exception):
                process.stop()


def drain_cli(*args: str, dsn: str, env: Mapping[str, str] | None = None, timeout_s: float = 120.0) -> Any:
    """Run one ``drain`` command to completion; return the CompletedProcess (text)."""
    return subprocess.run(
        [DRAIN, *args],
        env=environment(dsn, env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def status(config: Path, dsn: str) -> dict[str, Any]:
    done = drain_cli("status", "--json", "--config", str(config), dsn=dsn)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def elapsed(since: float) -> float:
    return time.monotonic() - since

"""deploy/systemd/drain.service: ``systemd-analyze verify`` finds nothing, the hardening scores
well offline, and the unit's exact ExecStart line, with the example env file (values pointed at
this test's database and Redis db), forwards jobs and exits 0 on SIGTERM.

The unit runs ``/opt/drain/bin/drain`` with ``/etc/drain``: the test maps those two folders onto
its venv's bin folder and a temporary folder, and changes nothing else in the line.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import drain
from drain import config
from tests.conftest import need_binary
from tests.deploy import files, flow
from tests.support import faultload
from tests.support.waiting import wait_until

UNIT_BIN = "/opt/drain/bin/"
UNIT_ETC = "/etc/drain/"
BIN = Path(sys.executable).parent
MAX_EXPOSURE = 2.0
TEST_WATCHDOG_USEC = 4_000_000


@pytest.fixture(scope="module")
def unit() -> dict[str, list[str]]:
    return files.unit_settings(files.UNIT.read_text())


def one(unit: dict[str, list[str]], key: str) -> str:
    (value,) = unit[key]
    return value


def local_unit(tmp_path: Path) -> Path:
    """The unit with only its program path pointed at this venv (verify checks it is executable)."""
    path = tmp_path / "drain.service"
    path.write_text(files.UNIT.read_text().replace(UNIT_BIN, f"{BIN}/"))
    return path


def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    analyze = need_binary("systemd-analyze", "systemd")
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(local_unit(tmp_path))],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    # verify exits 0 even for an unknown key: every line it prints is a finding.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_verify_reports_a_misspelled_key(tmp_path: Path) -> None:
    analyze = need_binary("systemd-analyze", "systemd")
    broken = local_unit(tmp_path)
    broken.write_text(broken.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(broken)], capture_output=True, text=True, check=False
    )
    assert "Unknown key" in done.stdout + done.stderr


def test_the_hardening_scores_ok_offline(tmp_path: Path) -> None:
    analyze = need_binary("systemd-analyze", "systemd")
    done = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(local_unit(tmp_path))],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for drain\.service: ([\d.]+)", done.stdout)
    assert found, done.stdout + done.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, done.stdout


def test_the_unit_is_wired_to_the_drains_notify_watchdog_and_exit_codes(unit: dict[str, list[str]]) -> None:
    assert one(unit, "Service.Type") == "notify"
    assert one(unit, "Service.NotifyAccess") == "main"
    # systemd's watchdog is the backstop: well above the drain's own bound for the example config.
    example = config.load(files.EXAMPLE_CONFIG, env=files.env_file(files.UNIT_ENV.read_text()))
    assert int(one(unit, "Service.WatchdogSec")) >= 2 * example.watchdog_bound_s()
    assert one(unit, "Service.Restart") == "on-failure"
    # 2: a configuration mistake, 4: refused to lead behind a transaction pooler.
    assert set(one(unit, "Service.RestartPreventExitStatus").split()) == {"2", "4"}
    assert one(unit, "Service.KillSignal") == "SIGTERM"
    assert int(one(unit, "Service.TimeoutStopSec")) > 30
    assert one(unit, "Service.DynamicUser") == "yes"
    assert one(unit, "Service.NoNewPrivileges") == "yes"
    assert one(unit, "Service.ProtectSystem") == "strict"
    assert one(unit, "Service.EnvironmentFile") == f"{UNIT_ETC}drain.env"


class Notifications:
    """A NOTIFY_SOCKET as systemd provides it: a unix datagram socket collecting the messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def read(self) -> list[str]:
        while True:
            try:
                self.messages += self.sock.recv(4096).decode().split("\n")
            except BlockingIOError:
                return self.messages

    def close(self) -> None:
        self.sock.close()


def speaks_sd_notify() -> bool:
    source = Path(drain.__file__).parent
    return any("NOTIFY_SOCKET" in path.read_text() for path in source.glob("*.py"))


@pytest.fixture
def service(
    database: str, redis_db: str, tmp_path: Path, unit: dict[str, list[str]]
) -> Iterator[tuple[list[str], dict[str, str]]]:
    """The unit's ExecStart argv and its environment, as systemd would start it."""
    etc = tmp_path / "etc-drain"
    etc.mkdir()
    shutil.copy(files.EXAMPLE_CONFIG, etc / "drain.toml")
    argv = [
        arg.replace(UNIT_BIN, f"{BIN}/").replace(UNIT_ETC, f"{etc}/")
        for arg in files.exec_start(files.UNIT.read_text())
    ]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    for line in unit.get("Service.Environment", []):
        env.update(pair.split("=", 1) for pair in line.split())  # type: ignore[misc]
    example = files.env_file(files.UNIT_ENV.read_text())
    assert set(example) >= {"DRAIN_DSN", "REDIS_URL", "DRAIN_METRICS_LISTEN"}
    env.update(example)
    env.update(
        DRAIN_DSN=database, REDIS_URL=redis_db, DRAIN_METRICS_LISTEN=f"127.0.0.1:{faultload.free_port()}"
    )
    yield argv, env


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")


def test_the_exec_start_line_forwards_jobs_and_stops_with_exit_0_on_sigterm(
    service: tuple[list[str], dict[str, str]],
    database: str,
    redis_db: str,
    tmp_path: Path,
    unit: dict[str, list[str]],
) -> None:
    argv, env = service
    assert argv[1:] == ["run", "--config", f"{tmp_path}/etc-drain/drain.toml"]
    log = tmp_path / "drain.log"
    process = start(argv, env, log)
    try:
        job_ids = flow.stage(database, ["app.tasks.send_welcome_email"] * 20)
        flow.wait_forwarded(database, redis_db, job_ids)
        # systemctl stop sends the unit's KillSignal= to the main process (KillMode=mixed).
        process.send_signal(getattr(signal, one(unit, "Service.KillSignal")))
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_the_drain_tells_systemd_it_is_ready_alive_and_stopping(
    service: tuple[list[str], dict[str, str]], database: str, redis_db: str, tmp_path: Path
) -> None:
    if not speaks_sd_notify():
        pytest.skip("this drain does not speak sd_notify yet (no NOTIFY_SOCKET in drain/)")
    argv, env = service
    notifications = Notifications(tmp_path / "notify.sock")
    env = {**env, "NOTIFY_SOCKET": str(notifications.path)}
    # systemd passes WatchdogSec as WATCHDOG_USEC; a short one here so pings come within the test.
    env["WATCHDOG_USEC"] = str(TEST_WATCHDOG_USEC)
    log = tmp_path / "drain.log"
    process = start(argv, env, log)
    try:
        wait_until("READY=1 on NOTIFY_SOCKET", lambda: "READY=1" in notifications.read(), 30)
        flow.wait_forwarded(database, redis_db, flow.stage(database, ["app.tasks.send_welcome_email"] * 5))
        wait_until("WATCHDOG=1 on NOTIFY_SOCKET", lambda: "WATCHDOG=1" in notifications.read(), 30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
        assert "STOPPING=1" in notifications.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        notifications.close()

"""The console in a real browser: headless Chromium (Debian's chromium and chromium-driver)
driven by selenium over a real ``drain console`` on a real database.

The overview, the filters, a dead letter opened, retry and purge of a filtered set (the rows
move, the counts change), the read-only refusal, and hostile rows shown as text with no script
run. With DRAIN_CONSOLE_SCREENSHOTS=DIR the pages are saved there as PNGs (the docs' pictures:
``DRAIN_CONSOLE_SCREENSHOTS=docs/operations/console pytest tests/console/test_console_browser.py``).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests import conftest
from tests.support import configs, console

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common import exceptions  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import wait  # noqa: E402

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,860",
)
SCREENSHOTS = os.environ.get("DRAIN_CONSOLE_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = conftest.need_binary("chromium", "chromium")
    driver_path = conftest.need_binary("chromedriver", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    with tempfile.TemporaryDirectory(prefix="drain-chromium-") as profile:
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(
            options=options, service=webdriver.ChromeService(executable_path=driver_path)
        )
        try:
            driver.set_page_load_timeout(30)
            yield driver
        finally:
            driver.quit()


def shoot(driver: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SCREENSHOTS) / f"{name}.png"))


def stage(dsn: str, rows: list[tuple[str, str, str, str | None]]) -> None:
    """Staged rows (job_name, queue, backend, run_at) for the overview's figures."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for job_name, queue, backend, run_at in rows:
            conn.execute(
                "INSERT INTO staged_jobs (job_name, queue, backend, run_at) VALUES (%s, %s, %s, %s)",
                (job_name, queue, backend, run_at),
            )


def submit(driver: Any, element_id: str) -> None:
    """Click a button or link and wait for the page it leads to (the old one gone, the new loaded)."""
    old = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.ID, element_id).click()
    waiting = wait.WebDriverWait(driver, 20)
    waiting.until(lambda _: gone(old))
    waiting.until(lambda d: d.execute_script("return document.readyState") == "complete")


def gone(element: Any) -> bool:
    """Whether ``element``'s page is gone. Chromium's driver may say so as an "unknown error"
    (the node "does not belong to the document") instead of a stale element reference, while
    the old page is being torn down: expected_conditions.staleness_of let that one through."""
    try:
        element.is_enabled()
    except exceptions.StaleElementReferenceException:
        return True
    except exceptions.WebDriverException as error:
        if "does not belong to the document" in str(error):
            return True
        raise
    return False


def text_of(driver: Any, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def matching(driver: Any) -> int:
    found = re.match(r"([\d,]+) dead letter", text_of(driver, "matching"))
    assert found is not None
    return int(found.group(1).replace(",", ""))


def sign_in(driver: Any, url: str, token: str = console.TOKEN) -> None:
    driver.get(url + "/login")
    driver.find_element(By.NAME, "name").send_keys("alice")
    driver.find_element(By.NAME, "token").send_keys(token)
    submit(driver, "sign-in-button")


def filter_by(driver: Any, url: str, **fields: str) -> None:
    driver.get(url + "/dead")
    for name, value in fields.items():
        box = driver.find_element(By.NAME, name)
        box.clear()
        box.send_keys(value)
    submit(driver, "apply")


def mail_failures(count: int) -> list[dict[str, Any]]:
    return [
        {
            "job_name": "mail.send",
            "queue": "mail",
            "kwargs": {"user_id": 40 + n, "template": "welcome", "smtp_password": "hunter2"},
            "error": "SMTPServerDisconnected: Connection unexpectedly closed",
        }
        for n in range(count)
    ]


def test_overview_filters_and_one_dead_letter(browser: Any, database: str, tmp_path: Path) -> None:
    stage(
        database,
        [("mail.send", "mail", "default", None)] * 3 + [("bill.charge", "billing", "payments", "2999-01-01")],
    )
    console.bury(
        database,
        [
            *mail_failures(4),
            {
                "job_name": "bill.charge",
                "backend": "payments",
                "queue": "billing",
                "ordering_key": "acct-7",
                "args": [1999, "EUR"],
                "error": "CardDeclined: insufficient funds",
            },
        ],
    )
    config = configs.write_config(
        tmp_path / "drain.toml",
        database,
        {"default": configs.memory(), "payments": configs.memory()},
        extra_toml='[[schedules]]\nname = "nightly-report"\ncron = "0 3 * * *"\njob_name = "reports.nightly"',
    )
    with console.running(database, tmp_path, args=["--config", str(config)]) as site:
        browser.get(site.url + "/")
        assert text_of(browser, "backlog") == "4"
        assert text_of(browser, "dead-count") == "5"
        assert "nightly-report" in text_of(browser, "schedules")
        assert "payments" in text_of(browser, "backends") and "billing" in text_of(browser, "backends")
        assert "No drain leads this table" in text_of(browser, "drains")
        shoot(browser, "console-overview")
        submit(browser, "dead-count")
        assert matching(browser) == 5
        filter_by(browser, site.url, job_name="mail.send", arg="41")
        assert matching(browser) == 1
        filter_by(browser, site.url, error="carddeclined")
        assert matching(browser) == 1
        old = browser.find_element(By.TAG_NAME, "html")
        browser.find_element(By.LINK_TEXT, "5").click()
        wait.WebDriverWait(browser, 20).until(lambda _: gone(old))
        assert "acct-7" in text_of(browser, "dead-letter")
        assert '"EUR"' in text_of(browser, "args")
        shoot(browser, "console-dead-letter")


def test_retry_and_purge_a_filtered_set(browser: Any, database: str, tmp_path: Path) -> None:
    console.bury(database, [*mail_failures(6), *[{"job_name": "thumb.make", "error": "OSError"}] * 4])
    with console.running(database, tmp_path) as site:
        sign_in(browser, site.url)
        assert "alice" in text_of(browser, "operator")
        filter_by(browser, site.url, job_name="mail.send")
        assert matching(browser) == 6
        shoot(browser, "console-dead-letters")
        submit(browser, "retry-all")
        assert "Retry 6 dead letter(s)?" in browser.find_element(By.TAG_NAME, "h1").text
        shoot(browser, "console-confirm")
        submit(browser, "confirm-button")
        assert "6 dead letter(s) staged again" in text_of(browser, "notice")
        assert matching(browser) == 0
        assert console.count(database, "staged_jobs") == 6
        filter_by(browser, site.url, job_name="thumb.make")
        boxes = browser.find_elements(By.CSS_SELECTOR, "#dead input[type=checkbox]")
        assert len(boxes) == 4
        for box in boxes[:3]:
            box.click()
        submit(browser, "purge-selected")
        assert "Purge 3 dead letter(s)?" in browser.find_element(By.TAG_NAME, "h1").text
        submit(browser, "confirm-button")
        assert "3 dead letter(s) purged" in text_of(browser, "notice")
        assert matching(browser) == 1
        browser.get(site.url + "/")
        assert text_of(browser, "dead-count") == "1" and text_of(browser, "backlog") == "6"
        log = site.process.output()
    assert "console: alice from 127.0.0.1: retry 6 dead letter(s) (6 confirmed" in log
    assert "console: alice from 127.0.0.1: purge 3 dead letter(s) (3 confirmed" in log
    assert console.count(database) == 1


def test_read_only_refuses(browser: Any, database: str, tmp_path: Path) -> None:
    console.bury(database, mail_failures(2))
    with console.running(database, tmp_path, token=None) as site:
        browser.delete_all_cookies()
        browser.get(site.url + "/dead")
        assert "read-only" in text_of(browser, "read-only")
        assert not browser.find_elements(By.ID, "retry-all")
        assert not browser.find_elements(By.CSS_SELECTOR, "#dead input[type=checkbox]")
    with console.running(database, tmp_path) as site:
        browser.delete_all_cookies()
        sign_in(browser, site.url, token="not-the-admin-token-at-all")
        assert "not the admin token" in text_of(browser, "failed")
        browser.get(site.url + "/dead")
        assert not browser.find_elements(By.ID, "purge-all")
    assert console.count(database) == 2


def test_hostile_rows_are_text_and_run_no_script(browser: Any, database: str, tmp_path: Path) -> None:
    script = "<script>document.title='pwned'</script>"
    handler = "<img src=x onerror=\"document.title='pwned'\">"
    bidi = "\u202etxt.exe"
    console.bury(
        database,
        [
            {
                "job_name": script,
                "queue": handler,
                "error": f"{bidi} <b onmouseover=alert(1)>bold</b>",
                "kwargs": {"html": handler, "blob": "B" * 2_000_000},
                "ordering_key": handler,
            }
        ],
    )
    with console.running(database, tmp_path) as site:
        browser.delete_all_cookies()
        for path in ("/dead", "/dead/1"):
            browser.get(site.url + path)
            assert "pwned" not in browser.title
            assert not browser.find_elements(By.TAG_NAME, "script")
            assert not browser.find_elements(By.CSS_SELECTOR, "main img, main b, [onerror], [onmouseover]")
            page = browser.find_element(By.TAG_NAME, "main").text
            assert script in page and handler in page
            assert "\u202e" not in page and "\\u202etxt.exe" in page
        assert script in text_of(browser, "job-name")
        assert len(text_of(browser, "kwargs")) < 70_000
        errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not [message for message in errors if "Content Security Policy" in message], errors

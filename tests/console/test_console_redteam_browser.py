"""Red team (console) in a real browser: a page of another site signs the operator out."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import console, faultload

pytest.importorskip("selenium.webdriver")
from tests.console.test_console_browser import browser, sign_in  # noqa: F401


def test_a_page_of_another_site_cannot_sign_the_operator_out(
    browser: Any,  # noqa: F811 - the fixture imported from test_console_browser
    database: str,
    tmp_path: Path,
) -> None:
    """The operator signs in on http://127.0.0.1:PORT, then opens a page of another site
    (http://localhost:OTHER, another site for SameSite) holding 1,001 images pointed at the
    console's /login; no script needed. Back on the console the operator is read-only again, and a
    confirmation open in another tab fails with "This form has expired". Expected: still signed in."""
    console.bury(database, [{"job_name": "a"}])
    images = "".join(f'<img src="{{url}}/login?n={n}" width=1 height=1>' for n in range(1_001))

    with console.running(database, tmp_path) as site:
        page = f"<!doctype html><title>cats</title>{images.replace('{url}', site.url)}".encode()

        class Attacker(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        port = faultload.free_port()
        attacker = http.server.ThreadingHTTPServer(("127.0.0.1", port), Attacker)
        thread = threading.Thread(target=attacker.serve_forever, daemon=True)
        thread.start()
        try:
            sign_in(browser, site.url)
            assert "admin: alice" in browser.page_source
            browser.get(f"http://localhost:{port}/")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not browser.execute_script(
                "return Array.from(document.images).every(i => i.complete)"
            ):
                time.sleep(0.2)
            browser.get(site.url + "/dead")
            signed_in = "admin: alice" in browser.page_source
        finally:
            attacker.shutdown()
            attacker.server_close()
    assert signed_in, "a page of another site signed the operator out"

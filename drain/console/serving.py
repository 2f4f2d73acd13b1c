"""The console on its port: uvicorn, one process, its log lines through drain's logging.

uvicorn installs its own SIGINT/SIGTERM handlers while it serves: either stops it gracefully.
"""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp


def serve(app: ASGIApp, host: str, port: int) -> None:
    """Serve ``app`` on ``host``:``port`` until a signal stops it (no access log: the console
    logs its actions itself). The client a log line names is the peer's own address: no
    X-Forwarded-For is believed (an SSH tunnel's requests come from 127.0.0.1, which uvicorn
    would otherwise trust as a proxy)."""
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,
        )
    )
    server.run()

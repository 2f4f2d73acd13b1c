"""``import drain`` in a web app stays light: the app side loads none of the drain process's modules.

The import-linter contract (pyproject.toml) says the same of the source; this says it of what a
fresh interpreter actually loads, ``drain/__init__.py`` included.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROCESS_SIDE = (
    "drain.relay",
    "drain.config",
    "drain.cli",
    "drain.console",
    "starlette",
    "uvicorn",
    "jinja2",
    "drain.store.session",
    "drain.observability.metrics",
    "drain.observability.server",
    "drain.observability.logs",
    "prometheus_client",
    "pythonjsonlogger",
    "cronsim",
    "tomllib",
)


def loaded_by(statement: str) -> list[str]:
    """Every module a fresh interpreter has loaded after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return list(json.loads(done.stdout))


@pytest.mark.parametrize(
    "statement",
    [
        "import drain",
        "from drain import stage, astage, Job",
        "import drain.staging.sync, drain.staging.aio",
        "import drain.contrib.django",
    ],
)
def test_the_app_side_loads_nothing_of_the_process_side(statement: str) -> None:
    loaded = loaded_by(statement)
    heavy = [
        name
        for name in loaded
        if name in PROCESS_SIDE or name.startswith(tuple(f"{m}." for m in PROCESS_SIDE))
    ]
    assert not heavy, f"{statement!r} loads {heavy}"


def test_the_process_side_is_what_the_check_looks_for() -> None:
    """The check sees a heavy module when one is loaded (else it would pass whatever drain did)."""
    loaded = loaded_by("import drain.cli")
    assert {"drain.config", "drain.relay.loop", "prometheus_client", "cronsim"} <= set(loaded)

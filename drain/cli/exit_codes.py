"""The exit codes of ``drain``; what each means is in the package docstring (drain.cli)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CHECK_FAILED = 3
EXIT_REFUSED = 4
EXIT_NOT_CONFIRMED = 5
EXIT_CANNOT_SETTLE = 6
EXIT_STOP_DEADLINE = 7
EXIT_FORCED = 143

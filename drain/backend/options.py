"""Read a TOML table into typed values, collecting every problem instead of stopping at the first.

Both the core config and each backend's settings use it, so a bad file is reported whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SHOWN_DIGITS = 20


def shown_number(value: float) -> str:
    """A number as a problem quotes it: an integer too long to read is shown by its length."""
    if isinstance(value, int) and abs(value) >= 10**SHOWN_DIGITS:
        return f"an integer of more than {SHOWN_DIGITS} digits"
    return str(value)


class OptionReader:
    """Typed getters over one mapping; each problem is recorded with the key's dotted name."""

    def __init__(self, values: Mapping[str, Any], prefix: str = "") -> None:
        self._values = values
        self._prefix = prefix
        self._seen: set[str] = set()
        self.problems: list[str] = []

    def name(self, key: str) -> str:
        return f"{self._prefix}{key}"

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        return self._values.get(key)

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{self.name(key)}: {message}")

    def string(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self._get(key)
        if value is None:
            if required:
                self.problem(key, "is required")
            return default
        if not isinstance(value, str) or not value:
            self.problem(key, "must be a non-empty string")
            return default
        return value

    def integer(self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self._get(key)
        if value is None:
            return default
        upper = "" if maximum is None else f" and at most {maximum}"
        if isinstance(value, bool) or not isinstance(value, int):
            within = (
                f", at least {minimum}{upper}" if isinstance(value, float) and maximum is not None else ""
            )
            self.problem(key, f"must be an integer{within}, not {value!r}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            self.problem(key, f"must be at least {minimum}{upper}, not {shown_number(value)}")
            return default
        return value

    def number(
        self, key: str, default: float, *, minimum: float = 0.0, maximum: float | None = None
    ) -> float:
        value = self._get(key)
        if value is None:
            return default
        upper = "" if maximum is None else f" and at most {maximum}"
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            self.problem(key, f"must be a finite number, not {value!r}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            self.problem(key, f"must be at least {minimum}{upper}, not {shown_number(value)}")
            return default
        return float(value)

    def timeout(self, key: str, default: float, publish_timeout_s: float) -> float:
        """A backend's own timeout: at least 0.1 s and at most the top-level ``publish_timeout_s``,
        from which the drain derives its session's fences (a longer wait inside a batch's
        transaction would outlive them: the session ends, and the batch goes again)."""
        value = self.number(key, default, minimum=0.1)
        if value > publish_timeout_s:
            self.problem(
                key,
                f"must be at most the top-level publish_timeout_s ({publish_timeout_s:g}),"
                f" not {value:g}: raise publish_timeout_s instead (the database"
                " session's timeouts are derived from it)",
            )
            return default
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problem(key, f"must be true or false, not {value!r}")
            return default
        return value

    def strings(self, key: str) -> tuple[str, ...] | None:
        value = self._get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            self.problem(key, "must be a list of non-empty strings")
            return None
        return tuple(value)

    def string_or_strings(self, key: str) -> tuple[str, ...] | None:
        """One non-empty string, or a non-empty list of them (a URL or a cluster's URLs)."""
        value = self._get(key)
        if value is None:
            return None
        if isinstance(value, str) and value:
            return (value,)
        if isinstance(value, list) and value and all(isinstance(item, str) and item for item in value):
            return tuple(value)
        self.problem(key, "must be a non-empty string or a non-empty list of non-empty strings")
        return None

    def table(self, key: str) -> Mapping[str, Any]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problem(key, "must be a table")
            return {}
        return value

    def finish(self) -> list[str]:
        """Report keys nobody asked for, and return every problem found."""
        for key in self._values:
            if key not in self._seen:
                self.problems.append(f"{self.name(key)}: unknown key")
        return self.problems

"""Which functions a module *defines*: the rule behind a safe RQ ``allowed_jobs``.

An RQ worker runs ``app.tasks.name`` by importing ``app.tasks`` and taking its attribute
``name``: whatever the module holds under that name, including what it merely imports
(``from subprocess import check_output`` makes ``app.tasks.check_output`` a shell). A function
the module defines is a plain Python function whose ``__module__`` is the module's name (a
``functools.wraps`` wrapper takes the wrapped function's). :func:`public_functions` lists the
public ones for ``drain allowed-jobs``, run where the workers run; the RQ worker job class
``drain_adapters.rq.job.CheckedJob`` applies :func:`defines` to every job it runs.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Sequence
from pathlib import Path

from drain import errors


def defines(module_name: str, obj: object) -> bool:
    """Whether ``obj`` is a plain Python function defined in the module named ``module_name``:
    not a builtin, class, callable object or partial, and not imported from elsewhere."""
    return inspect.isfunction(obj) and obj.__module__ == module_name


def is_public(name: str) -> bool:
    """A name an RQ job may use: a plain ASCII identifier not starting with ``_``."""
    return name.isascii() and name.isidentifier() and not name.startswith("_")


def public_functions(module: types.ModuleType) -> list[str]:
    """The dotted names of the public functions ``module`` defines, sorted."""
    return sorted(
        f"{module.__name__}.{name}"
        for name, obj in vars(module).items()
        if is_public(name) and defines(module.__name__, obj)
    )


def import_modules(names: Sequence[str], path: str) -> list[types.ModuleType]:
    """Import ``names`` with ``path`` first on sys.path (as a worker started there would); a
    module that cannot be imported is a ConfigError naming it and the exception's first line."""
    first = str(Path(path).resolve())
    if first not in sys.path:
        sys.path.insert(0, first)
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:  # noqa: BLE001 - any failure of the app's import is one line
            line = str(exc).splitlines()[0] if str(exc) else ""
            raise errors.ConfigError(f"cannot import {name}: {type(exc).__name__}: {line}") from None
    return modules


def toml_snippet(modules: Sequence[types.ModuleType], command: str) -> str:
    """``allowed_jobs = [...]`` for every public function ``modules`` define, with a comment
    saying how it was made; raises ConfigError when they define none."""
    names = [name for module in modules for name in public_functions(module)]
    if not names:
        listed = ", ".join(module.__name__ for module in modules)
        raise errors.ConfigError(f"{listed} define(s) no public function an RQ worker could run")
    lines = [
        f"# Written by `{command}`:",
        "# the public functions these modules define; what they import is left out on purpose.",
        "# Paste into the [backends.NAME] section of an RQ backend, and run this again when they change.",
        "allowed_jobs = [",
        *(f'    "{name}",' for name in names),
        "]",
    ]
    return "\n".join(lines) + "\n"

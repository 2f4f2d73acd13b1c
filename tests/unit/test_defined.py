"""drain.backend.defined: the functions a module defines, as ``drain allowed-jobs`` lists them and
drain_adapters.rq.job.CheckedJob checks them (issue 22)."""

from __future__ import annotations

import functools
import os
import subprocess
import types

import pytest

from drain import errors
from drain.backend import defined

SOURCE = """
import functools, os
from subprocess import check_output
from json import dumps as to_json

def send_email(to):
    return to

@functools.wraps(send_email)
def wrapped(to):
    return send_email(to)

def _private():
    pass

class Task:
    def run(self):
        pass

alias = send_email
lazy = functools.partial(send_email, "x")
handler = lambda event: event
shell = functools.wraps(check_output)(lambda *a: check_output(*a))
"""


def module() -> types.ModuleType:
    made = types.ModuleType("app.tasks")
    exec(compile(SOURCE, "app/tasks.py", "exec"), made.__dict__)
    return made


def test_only_the_public_functions_the_module_defines_are_listed() -> None:
    assert defined.public_functions(module()) == [
        "app.tasks.alias",
        "app.tasks.handler",
        "app.tasks.send_email",
        "app.tasks.wrapped",
    ]


@pytest.mark.parametrize(
    "obj", [subprocess.check_output, os.system, print, functools.partial(print), int, object()]
)
def test_imports_builtins_partials_classes_and_objects_are_not_defined_here(obj: object) -> None:
    assert not defined.defines("app.tasks", obj)


def test_the_snippet_is_toml_and_an_empty_module_is_an_error() -> None:
    snippet = defined.toml_snippet([module()], "drain allowed-jobs app.tasks")
    assert '    "app.tasks.send_email",' in snippet and "check_output" not in snippet
    with pytest.raises(errors.ConfigError, match=r"define\(s\) no public function"):
        defined.toml_snippet([types.ModuleType("empty")], "drain allowed-jobs empty")
    with pytest.raises(errors.ConfigError, match=r"cannot import no_such_module_here: ModuleNotFoundError"):
        defined.import_modules(["no_such_module_here"], ".")

"""The hierarchy drawn in drain.errors' docstring is the hierarchy of its classes."""

from __future__ import annotations

import inspect
import re

from drain import errors

BRANCH = re.compile(r"^(?P<indent>[│ ]*)[├└]── (?P<name>\w+)")


def drawn() -> dict[str, str]:
    """Each class drawn below the root, with the class it is drawn under."""
    doc = inspect.getdoc(errors) or ""
    parents: dict[str, str] = {}
    stack = ["DrainError"]
    lines = doc.splitlines()
    root = next(line for line in lines if line.strip() == "DrainError")
    margin = len(root) - len(root.lstrip())
    for line in lines:
        match = BRANCH.match(line[margin:])
        if match is None:
            continue
        depth = len(match.group("indent")) // 4 + 1
        del stack[depth:]
        parents[match.group("name")] = stack[-1]
        stack.append(match.group("name"))
    return parents


def test_every_error_is_drawn_under_its_base() -> None:
    classes = {
        name: value
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.DrainError) and value is not errors.DrainError
    }
    parents = drawn()
    assert set(parents) == set(classes)
    for name, parent in parents.items():
        bases = [base.__name__ for base in classes[name].__bases__]
        assert parent in bases, f"{name} is drawn under {parent}, but its bases are {bases}"

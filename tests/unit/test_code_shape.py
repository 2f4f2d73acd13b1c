"""Every class fits in 400 lines and every function in 80, in ``drain/`` and ``adapters/``: a sanity bound.

The limits are scripts/code_shape.py's (``python scripts/code_shape.py`` prints the figures).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "code_shape.py"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("code_shape", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_shape"] = module
    spec.loader.exec_module(module)
    return module


def test_no_class_or_function_over_the_limits() -> None:
    shape = load_script()
    over = sorted(f"{u.name} ({u.lines} lines)" for u in shape.oversized())
    limits = f"{shape.MAX_CLASS_LINES}-line classes / {shape.MAX_FUNCTION_LINES}-line functions"
    assert not over, f"over {limits}: {over}"


def test_the_measure_sees_an_oversized_function(tmp_path: Path) -> None:
    shape = load_script()
    module = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(shape.MAX_FUNCTION_LINES))
    module.write_text(f"def long():\n{body}\n\n\ndef short():\n    pass\n")
    sizes = {u.name.split(":")[1]: u.lines for u in shape.units(module, root=tmp_path)}
    assert sizes == {"long": shape.MAX_FUNCTION_LINES + 1, "short": 2}

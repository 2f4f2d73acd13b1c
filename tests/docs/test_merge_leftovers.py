"""No tracked file keeps a merge's conflict markers.

A merge once committed a README and a CHANGELOG with both sides of a conflict in them; the docs
build and every linter passed, as the markers sit in prose.
"""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKERS = ("<<<<<<< ", ">>>>>>> ")


def test_no_file_keeps_conflict_markers() -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if line.startswith(MARKERS)]
    assert not found, f"conflict markers left by a merge: {found}"

#!/usr/bin/env bash
# The main job end to end on the local services: installs, starts what is down, runs examples/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/services.sh
start_services
python3 -m venv .venv
.venv/bin/pip install --quiet -e '.[dev]'
exec .venv/bin/python examples/demo.py

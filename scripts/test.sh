#!/usr/bin/env bash
# Runs the whole test suite: unit, property and integration tests (real agent, simulated engines).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"

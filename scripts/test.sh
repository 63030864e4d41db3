#!/usr/bin/env bash
# Runs the whole test suite: unit, property and integration tests (real agent, simulated engines).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Several workers at once (TEST_WORKERS, default 3; `-n 0` after it runs one): most tests wait
# on processes and sockets, so one worker uses about a third of 2 cores. Each test file runs on
# one worker (its module fixtures are built once); the longest files are split below.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile "$@"

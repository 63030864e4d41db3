#!/usr/bin/env bash
# Runs the whole test suite: unit, property and integration tests (real agent, simulated engines).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# Several workers at once (TEST_WORKERS, default 3; `-n 0` among the arguments runs the suite in
# this process): most tests wait on processes and sockets, so one worker leaves most of 2 cores
# idle. Each test file runs on one worker, so its module fixtures are built once.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile "$@"

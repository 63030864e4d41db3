#!/usr/bin/env bash
# Runs the agent on its embedded default (simulated GPU and engines when no GPU is present),
# starts the seed's two sample models and shows them working. --keep-running leaves it up.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python scripts/demo.py "$@"

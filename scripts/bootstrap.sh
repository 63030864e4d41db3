#!/usr/bin/env bash
# Creates .venv (once) and installs the agent with its test dependencies into it.
set -euo pipefail
cd "$(dirname "$0")/.."
# promtool (Debian's prometheus package) checks the agent's /metrics exposition in the tests.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "promtool is missing: install Debian's 'prometheus' package (the metrics test needs it)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[test]'
  touch "$stamp"
fi

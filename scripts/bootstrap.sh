#!/usr/bin/env bash
# Creates .venv (once) and installs the agent with its test dependencies into it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Tools the tests use as real peers, from Debian when this runs as root (else they are named):
# promtool (package prometheus) checks the agent's /metrics exposition; Go (golang-go) decodes
# the agent's answers exactly as AIBrix's Go controller does (tests/test_aibrix_wire.py); tmux
# drives `runtime-agent top` by its keys (tests/test_operator_view.py).
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v go >/dev/null 2>&1 || missing+=(golang-go)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing tools for some tests: install Debian's ${missing[*]}" >&2
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

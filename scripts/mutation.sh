#!/usr/bin/env bash
# Mutation score of the engine owner, the process plumbing, vLLM's adapter and the KV-limit modules
# (docs/mutation.md): mutmut 3 over the direct unit tests named in pyproject's [tool.mutmut].
# Slow (about an hour for every mutant on 2 cores), so not part of CI (.ci/run).
#
#   scripts/mutation.sh           the stop, restart and wake paths (docs/mutation.md lists them)
#   scripts/mutation.sh --all     every mutant of the configured modules
#   scripts/mutation.sh NAME...   these mutants (mutmut names; * is a wildcard)
#
# Results stay in mutants/ (git-ignored): `.venv/bin/mutmut results`, `mutmut show NAME`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
[ -x .venv/bin/mutmut ] || .venv/bin/python -m pip install --quiet -e '.[mutation]'
jobs=${MUTATION_JOBS:-2}
owner='runtime_agent.supervision.owner'  # the owner's package: loop, life, ends, slots
paths=(
  "${owner}.ends.xǁEndsǁstop*" "${owner}.ends.xǁEndsǁafter_exit*"
  "${owner}.ends.xǁEndsǁ_add_log_tail*" "${owner}.ends.xǁEndsǁrevive*"
  "${owner}.loop.xǁEngineOwnerǁ_handle*" "${owner}.life.xǁLifeǁbegin*"
  "${owner}.life.xǁLifeǁ_adopt*" "${owner}.life.xǁLifeǁspawn*" "${owner}.life.xǁLifeǁ_spawn_now*"
  "${owner}.life.xǁLifeǁon_ready*" "${owner}.slots.*"
  "engines.process.*" "engines.vllm.*"
  "runtime_agent.kv.*"
)
if [ "${1:-}" = "--all" ]; then
  paths=()
  shift
fi
[ $# -gt 0 ] && paths=("$@")
nice .venv/bin/mutmut run --max-children "$jobs" "${paths[@]}"
# Counts by status over every mutant mutmut has a result for (killed, survived, timeout, ...).
.venv/bin/mutmut results --all true | awk -F': ' '{print $NF}' | sort | uniq -c

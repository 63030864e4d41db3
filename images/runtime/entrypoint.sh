#!/bin/sh
# Supervising entrypoint of the runtime images. tini runs it as its only child:
#
#   tini (PID 1, reaps orphans) -> this script -> runtime-agent serve "$@"
#
# The script starts `runtime-agent serve` with the container's arguments and starts it
# again, after a short backoff, whenever it exits, so an agent crash costs seconds and
# no container restart. It never touches the engines: they run in sessions of their own,
# outlive the agent, and the new agent re-adopts them from its registry (--state-dir,
# /var/run/aibrix). Engines orphaned by an agent exit are re-parented to tini, which
# reaps them.
#
# SIGTERM or SIGINT (a Pod or container stopping) is passed on to the agent as SIGTERM;
# the script waits for the agent to exit and then exits with the agent's status, which
# ends tini and the container.
#
# A first argument that is not an option runs that command instead of the agent
# (`docker run IMAGE bash`, `... IMAGE runtime-agent snapshot`); a leading `serve` is
# dropped, so `IMAGE serve --port 8080` works too.
#
# Settings (environment):
#   RUNTIME_AGENT_RESTART_DELAYS  seconds to wait before each successive restart, the
#                                 last repeated (default "1 2 4 8 15"; fractions allowed)
#   RUNTIME_AGENT_STABLE_SECONDS  an agent that ran this long resets the backoff (60)
#   RUNTIME_AGENT_BIN             the agent executable (default runtime-agent, on PATH)
set -u

if [ "$#" -gt 0 ] && [ "$1" = serve ]; then
  shift
fi
if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
  exec "$@"
fi

agent_bin=${RUNTIME_AGENT_BIN:-runtime-agent}
delays=${RUNTIME_AGENT_RESTART_DELAYS:-1 2 4 8 15}
stable=${RUNTIME_AGENT_STABLE_SECONDS:-60}

say() {
  echo "entrypoint: $*" >&2
}

child=""
sleeper=""
stopping=""
signalled=""
status=0

forward() {
  # $1: the signal received. The agent gets SIGTERM either way: it stops on SIGTERM
  # and SIGINT alike (leaving its engines running), but a background job of a
  # non-interactive shell may start with SIGINT ignored. A pending restart is called off.
  stopping=$1
  signalled=1
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null || true
  fi
  if [ -n "$sleeper" ]; then
    kill "$sleeper" 2>/dev/null || true
  fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT

# wait_for PID: waits until PID has exited and leaves its exit status in $status. A
# trapped signal makes `wait` return early, with a status above 128, while the process
# may still run; then `wait` is asked again. If the process had in fact ended and been
# reported already, that second `wait` answers 127 and the first status stands.
wait_for() {
  pending=""
  while :; do
    signalled=""
    wait "$1"
    rc=$?
    if [ "$rc" -eq 127 ] && [ -n "$pending" ]; then
      status=$pending
      return 0
    fi
    if [ -n "$signalled" ] && [ "$rc" -gt 128 ]; then
      pending=$rc
      continue
    fi
    status=$rc
    return 0
  done
}

attempt=0
while :; do
  started=$(date +%s)
  "$agent_bin" serve "$@" &
  child=$!
  say "started $agent_bin (pid $child)"
  # A signal that arrived before $child was set is passed on now.
  if [ -n "$stopping" ]; then
    kill -TERM "$child" 2>/dev/null || true
  fi
  wait_for "$child"
  child=""
  if [ -n "$stopping" ]; then
    say "agent stopped (status $status) after SIG$stopping; exiting"
    exit "$status"
  fi

  if [ $(($(date +%s) - started)) -ge "$stable" ]; then
    attempt=0
  fi
  attempt=$((attempt + 1))
  delay=""
  n=0
  for d in $delays; do
    n=$((n + 1))
    delay=$d
    if [ "$n" -ge "$attempt" ]; then
      break
    fi
  done
  say "agent exited with status $status; restarting in ${delay:-0}s (restart $attempt)"
  # Sleep in the background so that a signal is handled at once, not after the sleep.
  sleep "${delay:-0}" &
  sleeper=$!
  if [ -n "$stopping" ]; then
    kill "$sleeper" 2>/dev/null || true
  fi
  wait_for "$sleeper"
  sleeper=""
  if [ -n "$stopping" ]; then
    say "SIG$stopping while waiting to restart; exiting"
    exit 0
  fi
done

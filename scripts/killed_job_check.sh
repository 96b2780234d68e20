#!/usr/bin/env bash
# A killed job must leave the machine clean: starts a 2-PE shmem_chaos job under mpirun (kernels in rounds of
# put-with-signal, waits and atomics), sends SIGNAL to TARGET once every rank is ready, and checks that mpirun
# ends, that no rank outlives it, and that a fresh 2-PE job under the same transport then passes.
#   killed_job_check.sh SIGNAL TARGET TRANSPORT MPIRUN...   (run from a build directory)
#   SIGNAL: TERM, INT or KILL; TARGET: launcher (mpirun, as `timeout` or Ctrl-C reach it) or rank (PE 1 alone).
# With KILL to the launcher nothing is forwarded: the ranks end by MORI_EXIT_WITH_LAUNCHER.
# Prints one line of figures; exit 0 when every check held.
set -uo pipefail
set -m  # background jobs keep SIGINT (a shell without job control starts them with SIGINT ignored)
[ $# -ge 4 ] || { echo "usage: $0 TERM|INT|KILL launcher|rank TRANSPORT MPIRUN..." >&2; exit 2; }
sig=$1 target=$2 transport=$3
shift 3
mpirun=("$@")
tag="killed-job-$$-$RANDOM"
log=$(mktemp /tmp/killed-job.XXXXXX)
# Processes whose environment carries this run's tag (mpirun, its daemons and the ranks).
tagged() {
  grep -lsz "^KILLED_JOB_TAG=$tag\$" /proc/[0-9]*/environ 2>/dev/null | sed 's|/proc/\([0-9]*\)/environ|\1|' |
    grep -vx "$$" || true
}
ranks() { for p in $(tagged); do [[ "$(readlink "/proc/$p/exe" 2>/dev/null)" == */shmem_chaos ]] && echo "$p"; done; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
fail=0
problem() { echo "killed_job $sig $target $transport: $*"; fail=1; }

# Only the job carries the tag (this script's own subshells must not).
stop_env=()
[ -n "${MORI_STOP_ON_SIGNAL:-}" ] && stop_env=(-x MORI_STOP_ON_SIGNAL)
env KILLED_JOB_TAG="$tag" "${mpirun[@]}" -np 2 -x MORI_SHMEM_TRANSPORT="$transport" -x MORI_TIMEOUT_S=30 -x KILLED_JOB_TAG \
  "${stop_env[@]}" \
  ./tests/chaos/shmem_chaos --ready-after 20 > "$log" 2>&1 &
job=$!
deadline=$((SECONDS + 90))
while [ "$(grep -c ' ready after ' "$log")" -lt 2 ]; do
  if ! kill -0 "$job" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
    problem "the job did not get ready"
    cat "$log"
    kill -KILL "$job" $(tagged) 2>/dev/null
    exit 1
  fi
  sleep 0.1
done
sleep "0.$((RANDOM % 9 + 1))"
if [ "$target" = launcher ]; then
  victim=$job
else
  victim=$(for p in $(ranks); do grep -qz '^OMPI_COMM_WORLD_RANK=1$' "/proc/$p/environ" && echo "$p"; done | head -1)
  [ -n "$victim" ] || { problem "found no process of rank 1"; kill -KILL "$job" $(tagged); exit 1; }
fi
t0=$(now)
kill -"$sig" "$victim"
# mpirun: 30 s (Open MPI forwards TERM/INT to the ranks and waits for them); KILL to it ends it at once. Its ranks:
# with MORI_EXIT_WITH_LAUNCHER a rank whose launcher is gone ends within about 0.1 s plus its exit.
gone() { [ ! -e "/proc/$1" ] || [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ]; }
launcher_s="" ranks_s=""
for _ in $(seq 300); do
  [ -z "$launcher_s" ] && gone "$job" && launcher_s=$(elapsed "$t0")
  [ -z "$ranks_s" ] && [ -z "$(ranks)" ] && ranks_s=$(elapsed "$t0")
  [ -n "$launcher_s" ] && [ -n "$ranks_s" ] && break
  sleep 0.05
done
[ -n "$launcher_s" ] || { problem "mpirun still ran 15 s after the signal"; kill -KILL "$job"; }
wait "$job" 2>/dev/null
launcher_rc=$?
if [ -z "$ranks_s" ]; then
  problem "ranks $(ranks | paste -sd,) still ran 15 s after the signal"
  kill -KILL $(tagged) 2>/dev/null
fi
left=$(tagged | paste -sd,)
[ -z "$left" ] || { problem "processes $left of the job remain"; kill -KILL $(tagged) 2>/dev/null; }
# The next job on this GPU, right away.
next_log=$(mktemp /tmp/killed-job-next.XXXXXX)
t1=$(now)
timeout -k 5 120 "${mpirun[@]}" -np 2 -x MORI_SHMEM_TRANSPORT="$transport" -x MORI_TIMEOUT_S=20 \
  ./examples/shmem/shmem_put > "$next_log" 2>&1
next_rc=$?
next_s=$(elapsed "$t1")
[ $next_rc -eq 0 ] || { problem "the next job (shmem_put) failed with exit $next_rc"; cat "$next_log"; }
# Ranks that stopped their device waits before ending (core/stop.hpp; MORI_STOP_ON_SIGNAL=0 turns it off).
stopped=$(grep -c 'device waits stopped' "$log")
echo "killed_job $sig to $target, $transport: mpirun ended after ${launcher_s:-never} s (exit $launcher_rc)," \
  "no rank left after ${ranks_s:-never} s, $stopped rank(s) stopped their waits first" \
  "(MORI_STOP_ON_SIGNAL=${MORI_STOP_ON_SIGNAL:-1}); next shmem_put: exit $next_rc in $next_s s"
[ $fail -eq 0 ] || { echo "---- the killed job's output"; cat "$log"; }
rm -f "$log" "$next_log"
exit $fail

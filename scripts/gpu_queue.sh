#!/usr/bin/env bash
# GPU work as a queue of scripts/gpu_check.sh runs in the background of the device machine, so a
# device call that ends early (its time limit, the session's device time) loses nothing: each call
# of this script starts the queue once and then waits on it, and what the steps wrote so far is
# copied to $OUT every few seconds.
#
#   bash scripts/gpu_queue.sh STEPS [WAIT_S]     (the device command; call it again to keep waiting)
#
# STEPS: a file of steps, most important first, one a line: gpu_check.sh's variables, then after
# ` -- ` its bench models, e.g.
#   TESTS=tests/test_gpu_quant.py TEST_FILTER="gemv_against" SKIP_BENCH=1
#   SKIP_TESTS=1 BENCH_ARGS=--decode-only -- llama-3.1-8b@q4_k_m llama-3.1-8b@q4_0
# Step N writes gpu_check.sh's files to /tmp/gq/N/ (its output in run.log); all of /tmp/gq comes
# back as $OUT/gq.tgz, the queue's log (a line per step start and end) is printed. A step still
# running after STEP_LIMIT_S seconds (default 900) is stopped (rc 124) and the next one starts.
set -u
steps=${1:?usage: gpu_queue.sh STEPS [WAIT_S]}; wait_s=${2:-540}
q=/tmp/gq; OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if [ ! -e "$q" ]; then
  mkdir -p "$q"; cp "$steps" "$q/steps"
  setsid nohup bash -c '
    n=0
    while IFS= read -r line || [ -n "$line" ]; do
      [ -z "${line// }" ] && continue; n=$((n + 1)); d='"$q"'/$n; mkdir -p $d
      vars=${line%% -- *}; models=""; [[ $line == *" -- "* ]] && models=${line#* -- }
      echo "$(date +%T) step $n: $line"
      eval "timeout -k 10 '"${STEP_LIMIT_S:-900}"' env OUT=$d $vars bash scripts/gpu_check.sh $models" > $d/run.log 2>&1; rc=$?
      echo "$(date +%T) step $n ended: rc $rc"
    done < '"$q"'/steps
    touch '"$q"'/done' > "$q/queue.log" 2>&1 < /dev/null &
fi
for _ in $(seq $((wait_s / 10))); do
  [ -e "$q/done" ] && break
  sleep 10; tar czf "$OUT/gq.tgz" -C /tmp gq 2>/dev/null
done
tar czf "$OUT/gq.tgz" -C /tmp gq
cat "$q/queue.log"
[ -e "$q/done" ] && echo "queue done" || echo "queue still running: call again to keep waiting"

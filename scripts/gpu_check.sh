#!/usr/bin/env bash
# Everything fuselm checks on a GPU machine, in one go: install, GPU tests, benchmark.
# Usage (device machine): bash scripts/gpu_check.sh [bench models...]; results land in $OUT (or ./gpu_out).
# Bench models are presets, PRESET@SCHEME (quantized, e.g. llama-3.1-8b@q4_k_m) or checkpoint paths;
# the real-file GPU test reads .gpu_fixtures/ (carry it: scripts/trim_gguf.py makes its GGUF).
# SERVE=MODEL serves MODEL on the GPU and loads it with bench-serve (SERVE_OPTS: serve's options,
# SERVE_ARGS: bench-serve's), into $OUT/serve.json and serve.log; a preset name serves its shapes
# with random weights (scripts/serve_random.py, the carried SmolLM2 GGUF's tokenizer).
# ALT=FILE.tar (`git archive BRANCH -o FILE.tar`, carried) runs the same GPU tests and bench over
# that tree too, in the same run (A/B of a branch against this checkout): $OUT/alt_tests.log,
# alt_bench.log and alt_bench.json (ALT_TESTS=0: the bench only).
# SKIP_TESTS=1 / SKIP_BENCH=1 leave a part out; PEERS= (empty) skips the transformers comparison;
# BENCH_ARGS adds options to the bench (e.g. --decode-only); TESTS picks the GPU test files and
# TEST_FILTER (pytest -k) the tests among them. LOAD_TIME=1 times loading a random Q4_K_M GGUF of
# Llama-3.1-8B's shapes (scripts/load_time.py, the carried fixture's tokenizer) into $OUT/load.log;
# SAMPLING_TIME=1 times the GPU picks of sampled rows (scripts/sampling_time.py) into $OUT/sampling.log
# (and ALT's into alt_sampling.log).
# AB="FUSELM_TUNE=gemv_unroll=8;FUSELM_TUNE=attn_wide_warps=0" adds decode-only runs of $AB_MODELS, one
# per setting (A/B), printed to $OUT/ab.log and recorded as abN.json in $OUT/ab.tgz (whose "tuning"
# lists the values each ran under; one archive because the device tool brings back only a few files).
# AB_ARGS replaces the A/B runs' bench options (default --decode-only), e.g. "--prompts 512,4096".
# RUN="COMMAND" runs a command of its own after the rest (e.g. a script under ncu), into $OUT/cmd.log.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSELM_CACHE=${FUSELM_CACHE:-/tmp/fuselm-cache}
# bytecode kept between the steps' processes, as an installed package keeps it (a warm load timed
# without it compiled fuselm's modules again: 1.4 s of 5.5)
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/fuselm-pycache
if [ -d .whl ]; then   # packages the GPU image lacks (gguf), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
tests_rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest ${TESTS:-tests/test_gpu.py tests/test_gpu_quant.py} -m gpu -q -s -p no:cacheprovider \
    ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  models=${*:-llama-3.2-1b llama-3.1-8b smollm2-135m}
  python3 -m fuselm bench $models --profile --peers "${PEERS-hf}" ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
if [ -n "${ALT:-}" ]; then   # the other tree, imported as fuselm ahead of this checkout
  alt=$(mktemp -d); mkdir -p "$alt/src" && tar xf "$ALT" -C "$alt/src" && ln -s "$alt/src" "$alt/fuselm"
  if [ "${SKIP_TESTS:-0}" != 1 ] && [ "${ALT_TESTS:-1}" != 0 ]; then
    (cd "$alt/src" && PYTHONPATH="$alt:${PYTHONPATH:-}" python3 -m pytest ${TESTS:-tests/test_gpu.py tests/test_gpu_quant.py} \
      -m gpu -q -s -p no:cacheprovider ${TEST_FILTER:+-k "$TEST_FILTER"}) > "$OUT/alt_tests.log" 2>&1
    tests_rc=$(( tests_rc | $? ))
  fi
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    (cd /tmp && PYTHONPATH="$alt:${PYTHONPATH:-}" python3 -m fuselm bench ${*:-llama-3.2-1b llama-3.1-8b smollm2-135m} \
      --peers "" ${BENCH_ARGS:-} --json "$OUT/alt_bench.json") 2>&1 | tee "$OUT/alt_bench.log"
  fi
fi
if [ -n "${SERVE:-}" ]; then   # fuselm serve on the GPU, loaded by bench-serve (SERVE_ARGS: its options)
  if [ -e "$SERVE" ]; then   # a checkpoint; else a preset's shapes, random weights, the fixture's tokenizer
    python3 -m fuselm serve "$SERVE" --device cuda --port 8765 ${SERVE_OPTS:-} > "$OUT/serve.log" 2>&1 &
  else
    python3 scripts/serve_random.py "$SERVE" --tokenizer-from .gpu_fixtures/smollm2-q4_1-6layers.gguf \
      --port 8765 ${SERVE_OPTS:-} > "$OUT/serve.log" 2>&1 &
  fi
  server=$!
  for _ in $(seq 120); do python3 -c "import httpx; httpx.get('http://127.0.0.1:8765/health')" 2>/dev/null && break; sleep 1; done
  python3 -m fuselm bench-serve http://127.0.0.1:8765/v1 ${SERVE_ARGS:---clients 1,32} --json "$OUT/serve.json" 2>&1 \
    | tee -a "$OUT/serve.log"
  kill $server; wait $server 2>/dev/null
fi
if [ -n "${AB:-}" ]; then
  IFS=';' read -ra settings <<< "$AB"
  records=$(mktemp -d)
  for i in "${!settings[@]}"; do
    echo "== ${settings[$i]}" | tee -a "$OUT/ab.log"
    env ${settings[$i]} python3 -m fuselm bench ${AB_MODELS:-llama-3.2-1b llama-3.1-8b} ${AB_ARGS---decode-only} \
      --json "$records/ab$i.json" 2>&1 | tee -a "$OUT/ab.log"
  done
  tar czf "$OUT/ab.tgz" -C "$records" .
fi
if [ "${LOAD_TIME:-0}" = 1 ]; then
  python3 scripts/load_time.py --like .gpu_fixtures/smollm2-q4_1-6layers.gguf --json "$OUT/load.json" --profile 2>&1 | tee "$OUT/load.log"
fi
if [ "${SAMPLING_TIME:-0}" = 1 ]; then
  python3 scripts/sampling_time.py 2>&1 | tee "$OUT/sampling.log"
  if [ -n "${ALT:-}" ]; then   # the other tree's picks timed the same way
    (cd "$alt/src" && PYTHONPATH="$alt:${PYTHONPATH:-}" python3 scripts/sampling_time.py) 2>&1 | tee "$OUT/alt_sampling.log"
  fi
fi
if [ -n "${RUN:-}" ]; then
  bash -c "$RUN" 2>&1 | tee "$OUT/cmd.log"
fi
exit $tests_rc

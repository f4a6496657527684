#!/usr/bin/env bash
# What to run on the GPU machine, in the project root (offline: no pip install of our package).
#
#   scripts/device_run.sh [tests] [bench-decode] [bench-prefill] [-- EXTRA BENCH ARGS]
#
# No step named: all three. Each step runs under `timeout`; together they share one deadline
# (DEADLINE_S, default 570 s, so one call of at most 600 s returns with its logs). A step that
# starts with too little time left is skipped and says so. Results go to $OUT, flat, at most
# 8 files: env.txt tests.log bench_{decode,prefill}.{log,json,png}. The summary is printed last.
# Per-step caps: TESTS_S (default 420; the GPU tests in chunks of at most CHUNK_TESTS (12) of one
# file, JOBS (12) pytest processes at a time, each capped 20 s below the step; TEST_FILES: what to
# collect, default tests), DECODE_S (300), PREFILL_S (330).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"

steps=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; extra=("$@"); break ;;
    tests|bench-decode|bench-prefill) steps+=("$1") ;;
    *) echo "device_run.sh: unknown step '$1' (tests, bench-decode, bench-prefill)"; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -eq 0 ] && steps=(tests bench-decode bench-prefill)

if [ -f .whl/device_setup.sh ]; then
  # shellcheck disable=SC1091
  source .whl/device_setup.sh   # FlashInfer + cudnn-frontend wheels into /tmp/site, PYTHONPATH
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-570}
declare -A rc

# run_step NAME CAP_S LOG CMD...: the command under timeout, its output in LOG.
run_step() {
  local name=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE_S - SECONDS - 15))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 30 ]; then
    echo "$name: skipped, ${left}s left before the deadline" | tee "$log"
    rc[$name]=skipped
    return
  fi
  echo "== $name (limit ${limit}s) -> $log"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local r=$?
  [ $r -eq 124 ] && echo "$name: stopped at its ${limit}s limit" >>"$log"
  rc[$name]=$r
}

# gpu_test_chunks DIR: the GPU tests' ids from one collection (TEST_FILES: the files or folders to
# collect, default tests), cut into chunks of at most CHUNK_TESTS (default 12) consecutive ids of
# one file, as DIR/<file>.<n>.ids (32 line-plan tests of ~20 s each outlast the step's cap in one process).
gpu_test_chunks() {
  local dir=$1
  # shellcheck disable=SC2086
  "$PY" -m pytest --collect-only -m gpu -p no:cacheprovider ${TEST_FILES:-tests} 2>/dev/null | grep '::' >"$dir/ids.txt"
  awk -F'::' -v per="${CHUNK_TESTS:-12}" -v dir="$dir" '
    { if ($1 != file) { file = $1; k = 1; n = 0 } else if (n == per) { k++; n = 0 }
      n++; base = file; sub(/^.*\//, "", base); sub(/\.py$/, "", base)
      print > (dir "/" base "." k ".ids") }' "$dir/ids.txt"
}

# run_gpu_chunks DIR LIMIT_S: each chunk in its own pytest process (compiles are CPU-bound and the
# machine has many cores), JOBS (default 12) at a time, each under LIMIT_S, its log beside its ids.
run_gpu_chunks() {
  local dir=$1 limit=$2
  find "$dir" -name '*.ids' | sort -V | xargs -P "${JOBS:-12}" -I{} bash -c '
    mapfile -t ids <"$2"  # one id per line: ids may hold spaces
    timeout -k 5 "$1" "$PY" -m pytest -m gpu -p no:cacheprovider --maxfail=15 --durations=3 -rfE "${ids[@]}" \
      >"${2%.ids}.log" 2>&1
    echo "exit $?" >>"${2%.ids}.log"' _ "$limit" {}
}

# gpu_test_report DIR: the chunks' logs one after the other, then the tally (a chunk that never
# started or was stopped with the step says so).
gpu_test_report() {
  local dir=$1 f name
  for f in $(find "$dir" -name '*.log' | sort -V); do echo "=== $(basename "$f" .log)"; cat "$f"; done
  echo "=== tally ($(wc -l <"$dir/ids.txt") tests collected)"
  for f in $(find "$dir" -name '*.ids' | sort -V); do
    name=$(basename "$f" .ids)
    if [ ! -f "$dir/$name.log" ]; then echo "$name: not started ($(wc -l <"$f") tests)"
    elif ! grep -q '^exit ' "$dir/$name.log"; then echo "$name: stopped with the step ($(wc -l <"$f") tests)"
    elif grep -qE '^exit (124|137)$' "$dir/$name.log"; then
      echo "$name: stopped at its time limit ($(wc -l <"$f") tests)"
    else echo "$name: $(grep -E ' in [0-9.]+s' "$dir/$name.log" | tail -n 1) ($(grep '^exit ' "$dir/$name.log"))"
    fi
  done
}

{
  date -u
  timeout 30 nvidia-smi || echo "nvidia-smi failed"
  timeout 60 "$PY" - <<'PYEOF'
import importlib, importlib.metadata as md, sys
print("python", sys.version.split()[0])
for dist in ("torch", "triton", "flashinfer-python", "nvidia-cudnn-frontend", "apache-tvm-ffi", "pytest",
             "rich", "matplotlib"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "-")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "cudnn", torch.backends.cudnn.version())
except Exception as e:
    print("torch:", e)
PYEOF
} >"$OUT/env.txt" 2>&1
head -n 3 "$OUT/env.txt"

for step in "${steps[@]}"; do
  case "$step" in
    tests)
      if "$PY" -c "import pytest" 2>/dev/null; then
        tdir=$(mktemp -d /tmp/gpu_tests.XXXXXX)
        gpu_test_chunks "$tdir"
        per_chunk=$(( ${TESTS_S:-420} < DEADLINE_S - SECONDS - 40 ? ${TESTS_S:-420} - 20 : DEADLINE_S - SECONDS - 60 ))
        run_step tests "${TESTS_S:-420}" "$tdir/runner.log" \
          bash -c "$(declare -f run_gpu_chunks); run_gpu_chunks $tdir $per_chunk"
        gpu_test_report "$tdir" >"$OUT/tests.log"
      else
        echo "tests: pytest is not importable here (carry its wheel in .whl/)" | tee "$OUT/tests.log"
        rc[tests]=skipped
      fi ;;
    bench-decode)
      run_step bench-decode "${DECODE_S:-300}" "$OUT/bench_decode.log" "$PY" -m flashdispatch.bench decode \
        --plain --json "$OUT/bench_decode.json" --plot "$OUT/bench_decode.png" "${extra[@]}" ;;
    bench-prefill)
      run_step bench-prefill "${PREFILL_S:-330}" "$OUT/bench_prefill.log" "$PY" -m flashdispatch.bench prefill \
        --plain --json "$OUT/bench_prefill.json" --plot "$OUT/bench_prefill.png" "${extra[@]}" ;;
  esac
done

echo
echo "===== summary"
for step in "${steps[@]}"; do echo "$step: exit ${rc[$step]:-?}"; done
if [ -f "$OUT/tests.log" ]; then
  echo "--- tests.log (last lines)"
  sed -n '/^=== tally/,$p' "$OUT/tests.log"
fi
jsons=()
for f in "$OUT"/bench_decode.json "$OUT"/bench_prefill.json; do [ -f "$f" ] && jsons+=("$f"); done
if [ ${#jsons[@]} -gt 0 ]; then
  "$PY" -m flashdispatch.bench summary "${jsons[@]}"
fi

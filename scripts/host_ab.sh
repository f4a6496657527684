#!/usr/bin/env bash
# On the GPU machine: plan()/run() host time of an earlier tree against this one, alternated,
# each beside FlashInfer in its own process (scripts/host_vs_flashinfer.py), after the GPU tests
# of the paths a host-time change touches. Prepare the earlier tree here first and carry it:
#
#   rm -rf ab_base && mkdir ab_base && git archive BASE flashdispatch scripts | tar -x -C ab_base
#   (device run, carry [".whl", "ab_base"]):  scripts/host_ab.sh
#
# Knobs (environment): TESTS (pytest files, run with -m gpu), TESTS_S (their cap, s), SHAPES,
# REPS (alternations), MODES ("device host": where indptr and last_page_len live), ROUNDS, AB_S
# (cap per process, s), EXTRA (more arguments of host_vs_flashinfer.py, e.g. "--step-layers 32": the
# earlier tree's copy of the script must know them), PROFILE=N (then a cProfile of this tree's plan() at
# 256x1024, top N), LINES=1 (then this tree's plan() per statement at 256x1024, indptr on the device then the
# host: scripts/plan_line_times.py).
# Writes $OUT/gpu.txt, tests.log, ab.log, profile.log, lines.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
[ -d ab_base/flashdispatch ] || { echo "host_ab.sh: no ab_base/ tree (see the header)"; exit 2; }
# shellcheck disable=SC1091
[ -f .whl/device_setup.sh ] && source .whl/device_setup.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
# shellcheck disable=SC2086
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu \
  ${TESTS:-tests/test_device_read.py tests/test_api_host.py tests/test_page_check.py tests/test_replan.py} \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
for rep in $(seq 1 "${REPS:-2}"); do
  for tree in ab_base .; do
    for mode in ${MODES:-device host}; do
      echo "== rep $rep tree $tree indptr on the $mode"
      flag=()
      [ "$mode" = host ] && flag=(--host-indptr)
      # shellcheck disable=SC2086  # EXTRA: several arguments
      timeout "${AB_S:-120}" python3 "$tree/scripts/host_vs_flashinfer.py" \
        --shapes "${SHAPES:-256x1024,64x4096,1x32768}" --rounds "${ROUNDS:-9}" "${flag[@]}" ${EXTRA:-} 2>&1 \
        | grep -v "^host us\|Warning\|warn"
    done
  done
done 2>&1 | tee "$OUT/ab.log"
if [ -n "${PROFILE:-}" ]; then
  timeout "${AB_S:-120}" python3 scripts/host_vs_flashinfer.py --shapes 256x1024 --rounds 3 --profile "$PROFILE" 2>&1 \
    | tee "$OUT/profile.log"
fi
if [ -n "${LINES:-}" ]; then
  for flag in "" --host-indptr; do
    # shellcheck disable=SC2086  # flag: none or one argument
    timeout "${AB_S:-120}" python3 scripts/plan_line_times.py --device cuda $flag 2>&1
  done > "$OUT/lines.log"
fi

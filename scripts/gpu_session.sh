#!/usr/bin/env bash
# The GPU-side checks and measurements, in one command for a machine with a GPU:
#   scripts/gpu_session.sh tests   -> pytest -m gpu
#   scripts/gpu_session.sh bench   -> cudal2 bench at 4096^3 and 8192^3 (defaults, cuBLAS, torch)
#   scripts/gpu_session.sh devset  -> cudal2 bench on every row of shapes/dev.csv (DEVSET=path)
#   scripts/gpu_session.sh sweep   -> a grid of sm80_mma configurations at 4096^3
#   scripts/gpu_session.sh sweep-occupancy -> 128x128 tiles at two blocks per SM
# Logs, JSON and a tarball of the results directory go to ${OUT:-gpu-run}/.
set -uo pipefail
out=${OUT:-gpu-run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
results=${RESULTS:-gpu-results}  # merged into results/ by hand after review
cudal2() { python3 -m cudal2_cli "$@"; }

for stage in "$@"; do
  case "$stage" in
    tests)
      python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.log" ;;
    bench)
      cudal2 bench --m 4096 --n 4096 --k 4096 --results "$results" 2>&1 | tee "$out/bench-4096.txt"
      cudal2 bench --m 8192 --n 8192 --k 8192 --results "$results" 2>&1 | tee "$out/bench-8192.txt" ;;
    devset)  # every row of the shared dev shape set, default configurations: one JSON line per row
      tail -n +2 "${DEVSET:-../shared/shapes/dev.csv}" | while IFS=, read -r m n k dtype layout group; do
        cudal2 bench --m "$m" --n "$n" --k "$k" --dtype "$dtype" --layout "$layout" --budget 0.3 \
          --results "$results" --json | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)))"
      done 2>&1 | tee "$out/devset.jsonl" ;;
    sweep-occupancy)
      cudal2 bench --m 4096 --n 4096 --k 4096 --results "$results" --budget 0.3 --template sm80_mma \
        --param block_m=128 --param block_n=128 --param block_k=32,64 --param warps_m=2,4 --param warps_n=2,4 \
        --param stages=3,4 --param min_blocks=2 2>&1 | tee "$out/sweep-occupancy-4096.txt" ;;
    sweep)
      cudal2 bench --m 4096 --n 4096 --k 4096 --results "$results" --budget 0.3 --template sm80_mma \
        --param block_m=128,256 --param block_n=128,256 --param block_k=32,64 \
        --param warps_m=2,4 --param warps_n=2,4 --param stages=3,4 2>&1 | tee "$out/sweep-4096.txt" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
tar czf "$out/results.tgz" "$results" 2>/dev/null || true

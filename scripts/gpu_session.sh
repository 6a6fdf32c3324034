#!/usr/bin/env bash
# The GPU-side checks and measurements, in one command for a machine with a GPU:
#   scripts/gpu_session.sh tests   -> pytest -m gpu
#   scripts/gpu_session.sh bench   -> cudal2 bench at 4096^3 and 8192^3 (defaults, cuBLAS, torch)
#   scripts/gpu_session.sh devset  -> cudal2 bench on every row of tests/shapes/dev.csv (DEVSET=path)
#   scripts/gpu_session.sh devset-remeasure -> every dev row's best kernels (TOP per protocol) measured by
#     this version's protocol, then scripts/remeasure.py (an independent check) on the same rows
#   scripts/gpu_session.sh protocol-probe -> scripts/protocol_probe.py on dev rows ROWS (0-based, 0,1,2,3,4,5;
#     PROBE_ARGS="--graphs" for the graph method behind every neighbour, or "--leads 2,8")
#   scripts/gpu_session.sh winners -> examples/hf_llama.py (LAYERS, 2): its GEMMs tuned (ITERATIONS, 1), exported, patched in
#   scripts/gpu_session.sh ceiling -> what mma.sync can reach here: benchmarks/mma_sync_peak.cu, the memory
#     system's write, read and copy rates by working-set size (benchmarks/l2_bandwidth.cu), then
#     CUTLASS 2.x's Ampere GEMM (examples/cutlass2_sm80_gemm_fp16_nn.cu, four tilings) beside
#     the sm80_mma sweep grid at 4096^3, in one bench run
#   scripts/gpu_session.sh grid-sample -> SAMPLE (100) fresh random grid shapes (of REGIME, if set: "short-K",
#     "few-tile long-K") drawn with SEED (record it), none of RESULTS' problems nor of EXCLUDE's (a
#     results directory: earlier samples' leaderboards merged),
#     tuned by cudal2 optimize --shapes --time-budget BUDGET (5), then scripts/grid_sample.py's report
#     (screened per shape, wall time, best speedups by regime); run `cudal2 prebuild` first; SHAPES: a set drawn before
#   scripts/gpu_session.sh budget-compare -> SAMPLE (20) fresh grid shapes drawn with SEED, tuned twice from
#     empty results directories, at --time-budget SHORT (5) and LONG (60) s, then grid_sample.py compare
#     (the short budget's share of the long one's best); run `cudal2 prebuild` first. SHAPES (a CSV
#     drawn before, with its seed: `grid_sample.py draw`): its first SAMPLE shapes instead. With SHORT_JSON
#     (a grid-sample run's --json at the short budget): its first SAMPLE shapes, tuned at LONG alone
#   scripts/gpu_session.sh devset-optimize -> cudal2 optimize (search) on every row of DEVSET
#     (DEVSET_ROWS='1,8p;19p' picks data rows as a sed -n script; OPTIMIZE="..." sets its options)
# Logs, JSON and a tarball of the results directory go to ${OUT:-gpu-run}/.
set -uo pipefail
out=${OUT:-gpu-run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
results=${RESULTS:-gpu-results}  # merged into results/ by hand after review
cudal2() { python3 -m cudal2 "$@"; }
# A command's --json document as one line (a JSON-lines log).
oneline() { python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)))"; }

for stage in "$@"; do
  case "$stage" in
    tests)
      python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.log" ;;
    bench)
      cudal2 bench --m 4096 --n 4096 --k 4096 --results "$results" 2>&1 | tee "$out/bench-4096.txt"
      cudal2 bench --m 8192 --n 8192 --k 8192 --results "$results" 2>&1 | tee "$out/bench-8192.txt" ;;
    devset)  # every row of the shared dev shape set, default configurations: one JSON line per row
      tail -n +2 "${DEVSET:-tests/shapes/dev.csv}" | while IFS=, read -r m n k dtype layout group; do
        cudal2 bench --m "$m" --n "$n" --k "$k" --dtype "$dtype" --layout "$layout" --budget 0.3 \
          --results "$results" --json | oneline
      done 2>&1 | tee "$out/devset.jsonl" ;;
    devset-remeasure)  # the leaderboard's TOP (1) best kernels of every dev row under each protocol, measured
      # by this protocol (cudal2 bench --top), then the independent check (scripts/remeasure.py)
      tail -n +2 "${DEVSET:-tests/shapes/dev.csv}" | sed -n "${DEVSET_ROWS:-p}" \
        | while IFS=, read -r m n k dtype layout group; do
        cudal2 bench --m "$m" --n "$n" --k "$k" --dtype "$dtype" --layout "$layout" --top "${TOP:-1}" \
          --budget "${BUDGET:-0.3}" --results "$results" --json | oneline
      done 2>&1 | tee "$out/devset-remeasure.jsonl"
      python3 scripts/remeasure.py "${DEVSET:-tests/shapes/dev.csv}" "$results" --calls "${CALLS:-60}" --out "$out/remeasure.json" \
        2>"$out/remeasure.log" | tee "$out/remeasure.md" ;;
    protocol-probe)  # the protocol's times in variants where the independent check disagrees (scripts/protocol_probe.py)
      # with the SM clock and power logged beside it (nvidia-smi, every 50 ms)
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50 \
        > "$out/clocks.csv" 2>/dev/null & smi=$!
      python3 scripts/protocol_probe.py "${DEVSET:-tests/shapes/dev.csv}" "$results" --rows "${ROWS:-0,1,2,3,4,5}" ${PROBE_ARGS:-} \
        --out "$out/protocol-probe.json" 2>&1 | tee "$out/protocol-probe.md"
      kill "$smi" ;;
    winners)  # use the winners on this GPU: examples/hf_llama.py (tune, export, patch; eager and in graphs)
      python3 examples/hf_llama.py --layers "${LAYERS:-2}" --tune "--iterations ${ITERATIONS:-1} --batch 4" \
        --results "$results" --library "$out/hf-llama-library" --json "$out/hf-llama.json" 2>&1 | tee "$out/hf-llama.md" ;;
    devset-optimize)  # the search proposer on every row (warm-started from the leaderboard)
      tail -n +2 "${DEVSET:-tests/shapes/dev.csv}" | sed -n "${DEVSET_ROWS:-p}" \
        | while IFS=, read -r m n k dtype layout group; do
        cudal2 optimize --m "$m" --n "$n" --k "$k" --dtype "$dtype" --layout "$layout" \
          ${OPTIMIZE:---iterations 2 --batch 8 --patience 1 --budget 0.2} --results "$results" --json \
          | oneline
      done 2>&1 | tee -a "$out/devset-optimize.jsonl" ;;
    grid-sample)
      if [ -n "${SHAPES:-}" ]; then cp "$SHAPES" "$out/grid-sample.csv"; else  # a set drawn before
        python3 scripts/grid_sample.py draw --count "${SAMPLE:-100}" --seed "${SEED:?SEED: a seed never used before}" \
          --results "$results" ${EXCLUDE:+--results "$EXCLUDE"} ${REGIME:+--regime "$REGIME"} > "$out/grid-sample.csv"
      fi
      start=$(date +%s)
      cudal2 optimize --shapes "$out/grid-sample.csv" --time-budget "${BUDGET:-5}" --results "$results" --json \
        > "$out/grid-sample.json"
      echo "seed $SEED, budget ${BUDGET:-5} s: $(( $(date +%s) - start )) s wall" | tee "$out/grid-sample.md"
      python3 scripts/grid_sample.py report "$out/grid-sample.json" | tee -a "$out/grid-sample.md" ;;
    budget-compare)
      budgets=("${SHORT:-5}" "${LONG:-60}")
      if [ -n "${SHORT_JSON:-}" ]; then  # the short run made already: some of its shapes, at the long budget
        python3 scripts/grid_sample.py taken "$SHORT_JSON" --count "${SAMPLE:-20}" > "$out/budget-compare.csv"
        cp "$SHORT_JSON" "$out/budget-${SHORT:-5}.json"
        budgets=("${LONG:-60}")
      elif [ -n "${SHAPES:-}" ]; then  # the first SAMPLE shapes of a drawn set (a grid-sample's, say)
        head -n $(( ${SAMPLE:-20} + 1 )) "$SHAPES" > "$out/budget-compare.csv"
      else
        python3 scripts/grid_sample.py draw --count "${SAMPLE:-20}" --seed "${SEED:?SEED: a seed never used before}" \
          --results "$results" ${EXCLUDE:+--results "$EXCLUDE"} > "$out/budget-compare.csv"
      fi
      for budget in "${budgets[@]}"; do
        cudal2 optimize --shapes "$out/budget-compare.csv" --time-budget "$budget" --results "$out/budget-$budget" \
          --json > "$out/budget-$budget.json"
      done
      python3 scripts/grid_sample.py compare "$out/budget-${SHORT:-5}.json" "$out/budget-${LONG:-60}.json" \
        | tee "$out/budget-compare.md" ;;
    ceiling)
      nvcc -O3 -arch=sm_90a -o /tmp/mma_peak benchmarks/mma_sync_peak.cu && /tmp/mma_peak | tee "$out/mma-peak.txt"
      nvcc -O3 -arch=sm_90a -o /tmp/l2_bandwidth benchmarks/l2_bandwidth.cu && /tmp/l2_bandwidth | tee "$out/l2-bandwidth.txt"
      refs=()  # CUTLASS 2.x tilings: block M N K, warp M N, stages
      for v in "128 256 32 64 64 3" "256 128 32 64 64 3" "128 128 32 64 64 4" "128 256 64 64 64 3"; do
        set -- $v
        f=/tmp/cutlass2_sm80_${1}x${2}x${3}_w${4}x${5}_s${6}.cu
        { printf '#define CUDAL2_TILE_M %s\n#define CUDAL2_TILE_N %s\n#define CUDAL2_TILE_K %s\n' "$1" "$2" "$3"
          printf '#define CUDAL2_WARP_M %s\n#define CUDAL2_WARP_N %s\n#define CUDAL2_STAGES %s\n' "$4" "$5" "$6"
          cat examples/cutlass2_sm80_gemm_fp16_nn.cu; } > "$f"
        refs+=(--kernel "$f")
      done
      cudal2 bench --m 4096 --n 4096 --k 4096 --results "$results" --budget 0.3 "${refs[@]}" --template sm80_mma \
        --param block_m=128,256 --param block_n=128,256 --param block_k=32,64 \
        --param warps_m=2,4 --param warps_n=2,4 --param stages=3,4 --param epilogue=direct,smem \
        --param group_m=8,16 --json \
        > "$out/ceiling-4096.json" 2> "$out/ceiling-4096.err"; tail -3 "$out/ceiling-4096.err" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
tar czf "$out/results.tgz" "$results" 2>/dev/null || true
# Kernels compiled here, for the next machine's cache (CUDAL2_CACHE_DIR only).
[ -n "${CUDAL2_CACHE_DIR:-}" ] && tar czf "$out/cache.tgz" -C "$CUDAL2_CACHE_DIR" kernels 2>/dev/null || true

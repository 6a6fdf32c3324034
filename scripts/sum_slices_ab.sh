#!/usr/bin/env bash
# 1024x128x16384 fp16 nn, parallel split-K 64x128x128, 8 slices: the kernel as measured in the
# sixth round (its recorded source, whose sum_slices loop issued the slices' loads one by
# one) and the current template's (every load issued before the first add), in one bench
# process each time, ROUNDS times. One JSON document per line: ${OUT:-gpu-run}/sum-slices-ab.jsonl
set -uo pipefail
out=${OUT:-gpu-run}
mkdir -p "$out"
for _ in $(seq "${ROUNDS:-3}"); do
  python3 -m cudal2 bench --m 1024 --n 128 --k 16384 --budget 0.3 --results "${RESULTS:-gpu-results}" \
    --kernel results/sources/bbc993345109233991220c02a1c5ddae484284ade8b1ac599af796c3bdf112ab.cu \
    --template sm90_cutlass --param kernel_schedule=warpspecialized --param tile_m=64 --param tile_n=128 \
    --param tile_k=64,128 --param cluster_m=1 --param splits=8 --param reduction=parallel --json \
    | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)))"
done | tee "$out/sum-slices-ab.jsonl"

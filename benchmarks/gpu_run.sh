#!/usr/bin/env bash
# The GPU measurements behind docs/decisions.md, in one process tree per call:
#
#   OUT=DIR benchmarks/gpu_run.sh STEP [STEP ...]
#
# STEP: tests[:kernels|boundary|specialized|graph|bf16|producers] | tune:SIZES (e.g. tune:1,2,4,8) | specialized | speculative
#       | sweep[:M,M,...] | sweep-boundary[:T,T,...]
#       | ncu[:CASE,CASE,...] (Nsight Compute over benchmarks.profile_kernels' cases, e.g. ncu:dsa_group:1,boundary:8)
# (SWEEP_ARGS adds options to the sweep, e.g. "--skip-probe --variants heuristic,swap"; NCU_ARGS to the profiled script,
# e.g. "--variant bn32"; for two sweeps with different options, run this script twice in one call, with TRITON_PACK=0
# on all but the last: a step whose log an earlier one left takes the next free name, sweep-2.log, sweep-2.json;
# BUNDLE=1 on the last packs every log and JSON of the call into $OUT/results.tar.xz; CALL_END=$(( $(date +%s) + 580 ))
# at the top of a call cuts every step short of the call's limit, so the last run still packs its files.)
# Each step writes its log (and JSON) under $OUT and gets its own time limit, so one slow step
# leaves the others' results. Triton's compiled kernels go to $TRITON_CACHE_DIR (default
# .triton-cache in this tree, ignored by git), so a later call on the same machine skips compiling.
set -u
POLICY=
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
# Kernels an earlier call compiled: an archive a call left in $OUT (benchmarks/triton_cache.py), copied into
# the ignored folder .device-carry/ and named in the next call's carry. TRITON_PACK=0: leave none in
# $OUT this call (it is one of the 8 files a call brings back).
for archive in .device-carry/triton-cache*.tar.xz; do
    [ -f "$archive" ] && python benchmarks/triton_cache.py unpack "$archive" "$TRITON_CACHE_DIR"
done
pack_cache() {
    [ "${TRITON_PACK:-1}" = 0 ] || [ ! -d "$TRITON_CACHE_DIR" ] ||
        python benchmarks/triton_cache.py pack "$TRITON_CACHE_DIR" "$OUT/triton-cache.tar.xz"
    # BUNDLE=1: every other file under $OUT (this and earlier runs of the script in the call) into one
    # results.tar.xz, since a device call brings back at most 8 files.
    if [ "${BUNDLE:-0}" = 1 ]; then
        (cd "$OUT" && find . -maxdepth 1 -type f ! -name 'triton-cache*.tar.xz' ! -name 'results*.tar.xz' ! -name .bundle \
            -printf '%P\n' | sort > .bundle && tar -cJf results.tar.xz -T .bundle && xargs rm -f < .bundle; rm -f .bundle)
    fi
}
trap pack_cache EXIT

free() {  # free NAME: NAME, or NAME-2, NAME-3, ... where an earlier step (or run of this script) left NAME.log
    local name=$1 n=2
    while [ -e "$OUT/$name.log" ]; do name=$1-$n; n=$((n + 1)); done
    echo "$name"
}

run() {  # run NAME LIMIT_S CMD...
    local name=$1 limit=$2
    shift 2
    if [ -n "${CALL_END:-}" ]; then  # CALL_END: a Unix time by which every step must be done (the call's own limit)
        local left=$((CALL_END - $(date +%s) - 20))
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$limit" -le 0 ]; then echo "$name: skipped, CALL_END reached"; return; fi
    fi
    local t0=$SECONDS
    timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 4 "$OUT/$name.log"
}

for step in "$@"; do
    case $step in
        tests | tests:*)
            # tests:kernels, tests:specialized, tests:graph run one file each (the whole suite takes
            # over 7 minutes on a fresh machine, mostly compiling); tests:bf16 only the planned bf16
            # steps against fp32 (about 80 s).
            part=${step#tests}
            part=${part#:}
            files="-m gpu tests"
            case $part in
                "") ;;
                kernels) files="-m gpu tests/test_kernels_boundary.py tests/test_kernels_linear.py" ;;
                boundary) files="-m gpu tests/test_kernels_boundary.py" ;;
                specialized) files=tests/gpu/test_specialized.py ;;
                graph) files=tests/gpu/test_graph_decode.py ;;
                bf16) files="tests/gpu/test_specialized.py -k bf16_are_as_exact" ;;
                producers) files=tests/test_kernels_producers.py ;;  # the CPU file, on the GPU where it has one
                *) echo "unknown test part: $part (kernels, boundary, specialized, graph, bf16, producers)" >&2; exit 2 ;;
            esac
            run "$(free "gpu-tests${part:+-$part}")" 480 python -m pytest -v -rP -p no:cacheprovider \
                -o faulthandler_timeout=240 --durations=15 $files ;;
        tune:*)
            sizes=${step#tune:}
            # Each tune step merges into $OUT/policy.json, so tune:1,2,4,8 tune:16,24,32,48,64 leave the whole table;
            # a first tune step starts from the shipped H200 table, so tuning a few sizes leaves the others as shipped.
            [ -f "$OUT/policy.json" ] || cp glm5next/specialized_decode/policies/nvidia-h200.json "$OUT/policy.json"
            run "tune-${sizes//,/-}" 420 python -m glm5next.cli tune-policy --sizes "$sizes" \
                --out "$OUT/policy.json" --merge
            POLICY=$OUT/policy.json ;;
        specialized)
            # After a tune step of the same call (this run of the script or an earlier one, which left
            # $OUT/policy.json), with the table it wrote; else with the shipped one.
            [ -z "$POLICY" ] && [ -f "$OUT/policy.json" ] && POLICY=$OUT/policy.json
            name=$(free specialized)
            run "$name" 420 python -m glm5next.cli bench --mode specialized --out "$OUT/$name.json" \
                ${POLICY:+--policy "$POLICY"} ;;
        speculative)
            run speculative 420 python -m glm5next.cli bench --mode speculative --requests 1,4,16 \
                --num-speculative-tokens 2 --replays 10 --out "$OUT/speculative.json" ;;
        sweep | sweep:*)
            m=${step#sweep}
            m=${m#:}
            name=$(free sweep)
            run "$name" 420 python -m benchmarks.sweep --skip-boundary --m "${m:-1,8,16,32,64}" \
                --out "$OUT/$name.json" ${SWEEP_ARGS:-} ;;
        sweep-boundary | sweep-boundary:*)
            # The boundary's (block_t, chunk) tilings at the given token counts, with the module's defaults.
            t=${step#sweep-boundary}
            t=${t#:}
            # (SWEEP_ARGS narrows the tilings, e.g. "--block-t 1 --chunks 32,64,128": about 14 s each, mostly compiling.)
            name=$(free sweep-boundary)
            run "$name" 300 python -m benchmarks.sweep --skip-linear --skip-probe --t "${t:-1,4,8,16}" \
                --out "$OUT/$name.json" ${SWEEP_ARGS:-} ;;
        ncu | ncu:*)
            # The details page (throughput, stall reasons, occupancy) and the per-instruction SASS counters as
            # text; the report itself stays under $OUT as ncu.ncu-rep.
            cases=${step#ncu}
            cases=${cases#:}
            ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
            run ncu 200 "$ncu" --clock-control none --set full --import-source yes -k 'regex:skinny|mhc' -f \
                -o "$OUT/ncu" python -m benchmarks.profile_kernels ${cases:+--cases "$cases"} ${NCU_ARGS:-}
            "$ncu" -i "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
            "$ncu" -i "$OUT/ncu.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-sass.csv" 2>&1
            echo "ncu export: $(wc -l < "$OUT/ncu-details.txt") detail lines, $(wc -l < "$OUT/ncu-sass.csv") sass lines" ;;
        *)
            echo "unknown step: $step (tests[:PART], tune:SIZES, specialized, speculative, sweep[:M,...], sweep-boundary[:T,...], ncu[:CASES])" >&2
            exit 2 ;;
    esac
done

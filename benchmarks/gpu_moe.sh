#!/usr/bin/env bash
# The MoE stage's GPU checks and measurements in one call: OUT=DIR benchmarks/gpu_moe.sh [STEP ...]
# STEP: tests | stage[:TOKENS] | variants[:TOKENS] | profile[:TOKENS] | specialized | tune[:SIZES] (the MoE stage's table)
# The policy the planned steps run: $POLICY, default the shipped H200 table with the MoE stage at every size.
set -u
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if [ -z "${POLICY:-}" ]; then
    POLICY=$OUT/policy.json
    python - "$POLICY" <<'PY'
import json, sys
p = json.load(open("glm5next/specialized_decode/policies/nvidia-h200.json"))
p["tables"]["moe"] = {str(m): "grouped" for m in (1, 2, 4, 8, 16, 24, 32, 48, 64)}
json.dump(p, open(sys.argv[1], "w"), indent=1)
PY
fi
run() {  # run NAME LIMIT_S CMD...
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s"
    tail -n 12 "$OUT/$name.log"
}
for step in "$@"; do
    arg=${step#*:}; [ "$arg" = "$step" ] && arg=
    case $step in
        tests) run tests ${TESTS_LIMIT:-120} python -m pytest -q -x -m gpu tests/test_kernels_moe.py ;;
        stage*) run stage ${STAGE_LIMIT:-200} python benchmarks/moe_stage.py ${STAGE_ARGS:-} --tokens "${arg:-1,2,4,8,16,32,64}" \
                    --out "$OUT/stage.json" ;;
        variants*) run variants 300 python benchmarks/moe_stage.py --no-peer --variants --tokens "${arg:-1,8,64}" \
                       --out "$OUT/variants.json" ;;
        profile*) run profile ${PROFILE_LIMIT:-180} python benchmarks/profile_step.py --stock --tokens "${arg:-1,8,64}" --policy "$POLICY" \
                      --out "$OUT/profile.json" ;;
        specialized) run specialized 420 python -m glm5next.cli bench --mode specialized --policy "$POLICY" \
                         --out "$OUT/specialized.json" ;;
        tune*) run tune 420 python -m glm5next.cli tune-policy --stages moe --sizes "${arg:-1,2,4,8,16,24,32,48,64}" \
                   --out "$OUT/policy-moe.json" ;;
    esac
done

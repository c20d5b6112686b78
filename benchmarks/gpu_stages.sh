#!/usr/bin/env bash
# One device call for the stages: GPU tests, the planned and stock step profiles (the KDA stage on over the
# Hopper default policy), the KDA stage table with its plan variants, the MoE stage with its peers, KDA
# prefill against fla, and the DSA stage where this checkout has it. Logs gather in $OUT/run.log (few files
# come back per call). fla travels as a wheel in .whl/ (see the device tool's notes).
#     OUT=DIR bash benchmarks/gpu_stages.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > /tmp/gpu.txt 2>&1
cat /tmp/gpu.txt; cat /tmp/gpu.txt > "$OUT/run.log"
run() { local name=$1 limit=$2 t0=$SECONDS; shift 2; timeout -s INT "$limit" "$@" > "/tmp/$name.log" 2>&1; local rc=$?
  { echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; grep -v "_warn_once\|UserWarning" "/tmp/$name.log"; } >> "$OUT/run.log"; echo "$name: rc=$rc in $((SECONDS - t0)) s"; tail -n ${TAIL:-14} "/tmp/$name.log"; }
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
python - /tmp/policy.json <<'PY'
import json, sys
p = json.load(open("glm5next/specialized_decode/policies/sm90.json"))
p["tables"]["kda"] = {str(m): "fused" for m in (1, 2, 4, 8, 16, 24, 32, 48, 64)}
json.dump(p, open(sys.argv[1], "w"), indent=1)
PY
run tests 60 python -m pytest -q -m gpu tests/test_kernels_kda.py tests/test_kernels_moe.py $(ls tests/test_kernels_dsa.py 2>/dev/null)
run profile 100 python benchmarks/profile_step.py --stock --tokens 1,8,64 --policy /tmp/policy.json --out "$OUT/profile.json"
run kda-stage 45 python benchmarks/kda_stage.py --tokens 1,2,4,8,16,32,64 --verify 2x4,16x4 --block-v 64,128 --warps 4,8 --out "$OUT/kda-stage.json"
run moe-stage 70 python benchmarks/moe_stage.py --profile --tokens 1,8,64 --out "$OUT/moe-stage.json"
run kda-prefill 40 python benchmarks/kda_prefill.py
[ -f benchmarks/dsa_stage.py ] && run dsa-stage 50 python benchmarks/dsa_stage.py --contexts 8192 --tokens 1,8,64 --out "$OUT/dsa-stage.json"

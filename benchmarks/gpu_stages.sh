#!/usr/bin/env bash
# The stages on a GPU in device calls of under 10 minutes each. PART=1: the stages' GPU tests, the planned
# step profiles at 8K and 128K (the shipped policy), the KDA stage against fla. PART=2: the MoE and DSA
# stages against their floors and the stock modules, the KDA chunked forms against fla's chunk_kda, the DSA
# attention's tiles on a prefill chunk, the executor's GPU tests with every stage on. PART=3: prefill (its
# GPU tests, the slice's 8192-token prompt by sublayer and kernel, the GPU's idle time between its kernels
# and what the host did then, before a change too). PART=4: the prefill experts' plans against the form
# before, torch._grouped_mm and their TMA form, the boundary's plans over long rows. PART=5: the engine
# end to end (steady decode against the captured step, host time, prefill of 1K / 8K / 32K prompts alone
# and 8 together, an 8K prompt beside 16 decodes under step budgets of 512 / 2048 / 8192 tokens). PART=6:
# the graph tests (asynchronous scheduling through captured graphs against one step at a time), fla's
# chunk_kda with its chunk list on the device or sized from the host's lengths (time, equality, syncs), and
# with fla's split of long sequences over the SMs (FLA_INTRACARD_CP=1).
# PART=7: the whole GPU suite (SUITE=1|2|3|4: a quarter of it). PART=8: the MoE plan's variants. PART=9:
# issue 25's structure before/after. PART=10: the engine's steps of 64 requests and its prompts alone.
# PART=11: the MoE launches as programmatic dependents (GPU tests, the stage with and without, the step
# profile against the package of commit $BASE unpacked in benchmarks/.b/$BASE as PART=9 says), the KDA stage.
# PART=12: the engine's startup warm-up (engine_steps.py: its time and kernel variants, then the requests' steps).
# PART=19: the MoE's shared expert on a second stream beside the routing (its GPU tests and the executor's, the
# stage's plan variants, the step against the package of commit $BASE).
# PART=20: the three stages on a GPU (a kind the plans were not measured on, e.g.): their GPU tests, the MoE, KDA
# and DSA stages at 1-64 tokens against their floors, stock and peers, the step against the package of $BASE.
# PART=22: the three stages' tables alone (moe_stage / kda_stage / dsa_stage at 1-64 tokens with the stock module,
# the input of stage_tables.py on a GPU kind without tables).
# PART=29: s49's untimed forms (git revert 6876cdf 6346d69 bd5c815 first; BASE=6735f4e with its benchmarks unpacked in
# benchmarks/.b/6735f4e): the one-token KDA form (GPU tests, the stage against the form before it), KDA plans at
# 1-8 rows; the DSA reads beside the slot (DSA GPU tests, the stage kernel by kernel against BASE's); the DSA
# value-up's pipeline stages.
# PART=15: the DSA selection alone (dsa_select.py) and the DSA stage, here and on the package of commit $BASE
# unpacked in benchmarks/.b/$BASE (as PART=9 says), with the selection's GPU tests.
# A fresh machine compiles every kernel first: the first part run there needs the longest limits. Logs
# gather in $OUT/run.log (few files come back per call). fla travels as a wheel in .whl/ (see the device
# tool's notes). Triton's compiled kernels travel too: a call unpacks .triton/cache.tar.gz (ignored; carry it)
# into its cache and packs the cache back into $OUT/triton-cache.tar.gz, to be copied to .triton/ for the
# next fresh machine (the same kernels on any SM90 GPU with the same Triton hit it instead of compiling).
#     OUT=DIR PART=1 bash benchmarks/gpu_stages.sh   (then PART=2 ... PART=9)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton/cache.tar.gz ] && tar -xzf .triton/cache.tar.gz -C "$TRITON_CACHE_DIR"
pack_cache() {  # at most 16 MiB comes back per file: a larger cache stays behind
  tar -czf /tmp/triton-cache.tar.gz -C "$TRITON_CACHE_DIR" . && [ "$(stat -c %s /tmp/triton-cache.tar.gz)" -lt 16000000 ] \
    && cp /tmp/triton-cache.tar.gz "$OUT/" || echo "triton cache not packed: $(du -sh "$TRITON_CACHE_DIR")" >> "$OUT/run.log"; }
[ "${PACK:-1}" = 1 ] && trap pack_cache EXIT  # PACK=0: no cache comes back (packing a large one takes a while)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > /tmp/gpu.txt 2>&1
cat /tmp/gpu.txt; cat /tmp/gpu.txt > "$OUT/run.log"
run() { local name=$1 limit=$2 t0=$SECONDS; shift 2; timeout -s INT "$limit" "$@" > "/tmp/$name.log" 2>&1; local rc=$?
  { echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; grep -v "_warn_once\|UserWarning" "/tmp/$name.log"; } >> "$OUT/run.log"; echo "$name: rc=$rc in $((SECONDS - t0)) s"; tail -n ${TAIL:-14} "/tmp/$name.log"; }
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
if [ "${PART:-1}" = 3 ]; then
run prefill-tests 220 python -m pytest -q -m gpu tests/test_kda.py tests/test_kernels_kda.py tests/test_kernels_dsa.py \
  tests/test_kernels_linear.py tests/test_kernels_moe.py -k "prefill or widen"
run prefill 150 python benchmarks/profile_prefill.py --tokens 8192 --out "$OUT/prefill.json"
run prefill-gaps 90 python benchmarks/prefill_gaps.py --tokens 8192 --out "$OUT/prefill-gaps.json"
# The prefill before a change, in the same run: the package of an earlier commit unpacked beforehand with
#     mkdir -p benchmarks/.base && git archive COMMIT glm5next | tar -x -C benchmarks/.base
# (untracked, so it travels; delete it afterwards).
[ -d benchmarks/.base ] && PYTHONPATH=benchmarks/.base:${PYTHONPATH#.:} run prefill-base 120 \
  python benchmarks/profile_prefill.py --tokens 8192 --out "$OUT/prefill-base.json"
elif [ "${PART:-1}" = 4 ]; then
run moe-prefill 240 python benchmarks/moe_prefill.py --out "$OUT/moe-prefill.json"
run boundary-rows 140 python benchmarks/boundary_rows.py --out "$OUT/boundary-rows.json"
elif [ "${PART:-1}" = 6 ]; then
run graph-and-kda-tests 240 python -m pytest -q -m gpu -rfE --tb=short tests/gpu/test_graph_decode.py \
  tests/test_kernels_kda.py::test_prefill_real_shapes_bf16_against_fp32
run kda-prefill 90 python benchmarks/kda_prefill.py --out "$OUT/kda-prefill.json"
FLA_INTRACARD_CP=1 run kda-prefill-split 90 python benchmarks/kda_prefill.py --out "$OUT/kda-prefill-split.json"
elif [ "${PART:-1}" = 7 ]; then
# The whole GPU suite (141 cases: the files below, not all of tests/, whose server modules import packages
# the GPU machines lack) in one call, or in four (SUITE=1 the KDA, MoE and DSA kernels and modules (26),
# SUITE=2 the boundary kernels (37), SUITE=3 the projection kernels (63), SUITE=4 the executor and the
# captured graphs (15)).
case "${SUITE:-all}" in
  all) files="tests/test_kernels_kda.py tests/test_kernels_moe.py tests/test_kernels_dsa.py tests/test_kda.py
             tests/test_batch_sampler.py tests/test_kernels_boundary.py tests/test_kernels_linear.py tests/gpu" ;;
  1) files="tests/test_kernels_kda.py tests/test_kernels_moe.py tests/test_kernels_dsa.py tests/test_kda.py tests/test_batch_sampler.py" ;;
  2) files="tests/test_kernels_boundary.py" ;;
  3) files="tests/test_kernels_linear.py" ;;
  *) files="tests/gpu" ;;
esac
# Compiling is most of a fresh machine's time and runs on the host's cores: the suite's cases spread over
# WORKERS processes (pytest-xdist; one GPU shared, correctness only) sharing one Triton cache.
xdist=""; python -c "import xdist" 2>/dev/null && xdist="-n ${WORKERS:-8}"
run "gpu-suite-${SUITE:-all}" ${LIMIT:-560} python -m pytest -q -m gpu -rfE --tb=short $xdist $files
elif [ "${PART:-1}" = 8 ]; then
# The MoE plan's variants against the production plan, each output checked against the fp32 reference:
# MOE_TOKENS (1,2,4,8), MOE_FIELDS (single-field changes, see moe_stage.py's VARIANTS), MOE_PLANS
# ("f=v,f=v;..." several-field plans). s41 (H100) picked the gate|up columns and top-k+grouping this way.
run moe-variants ${MOE_LIMIT:-270} python benchmarks/moe_stage.py --no-peer --tokens ${MOE_TOKENS:-1,2,4,8} --variants \
  --fields ${MOE_FIELDS:-gate_up_block_n,down_block_n,topk_group} --plans "${MOE_PLANS:-}" --out "$OUT/moe-variants.json"
elif [ "${PART:-1}" = 9 ]; then
# Issue 25's same-run before/after of the restructuring: `bench --mode specialized` on the packages of two
# commit pairs that differ by the structure work alone (da46c84 -> 095c8fe: the forward.py leaf, checkpoint
# specs, EngineArgs, imports at the top; 11f0e7c -> 3816bd3: one production path per kernel, the lab out of
# the package, stages called explicitly, model/routing.py gone), the H200 table of each. Unpack them first:
#     for c in da46c84 095c8fe 11f0e7c 3816bd3; do mkdir -p benchmarks/.b/$c
#       git archive $c glm5next | tar -x -C benchmarks/.b/$c; done
# (untracked, so they travel; delete them afterwards). ~2 minutes each on a fresh machine.
for c in ${COMMITS:-da46c84 095c8fe 11f0e7c 3816bd3}; do
  (cd "benchmarks/.b/$c" && PYTHONPATH=. run "structure-$c" 140 python -m glm5next.bench.cli --mode specialized \
    --policy glm5next/specialized_decode/policies/nvidia-h200.json --tokens 1,8,64 --skip-eager --skip-graph \
    --skip-e2e --replays 20 --out "$OUT/structure-$c.json")
done
elif [ "${PART:-1}" = 10 ]; then
# s42's open engine questions: each step of 64 short requests twice over (its rows, its time, the kernel
# variants it loads: the 24.8 s first tokens of s42's second round), then the engine's prompts of 8192 and
# 32768 tokens alone and 8 together at the default step budget (16384 tokens on an H100 / H200).
run engine-steps 300 python benchmarks/engine_steps.py --concurrency 64 --out "$OUT/engine-steps.json"
run e2e-prefill 240 python -m glm5next.bench.cli --mode specialized --tokens 1 --concurrency "" --skip-eager \
  --skip-graph --prefill-lens 8192,32768 --prefill-requests 1,8 --out "$OUT/e2e-prefill.json"
elif [ "${PART:-1}" = 11 ]; then
run moe-tests 200 python -m pytest -q -m gpu -rfE --tb=short tests/test_kernels_moe.py
run moe-pdl 200 python benchmarks/moe_stage.py --no-peer --tokens 1,2,4,8,16,32,64 --variants --fields pdl \
  --out "$OUT/moe-pdl.json"
run profile 150 python benchmarks/profile_step.py --tokens 1,8,64 --out "$OUT/profile.json"
(cd "benchmarks/.b/$BASE" && cp ../../profile_step.py . && PYTHONPATH=.:/tmp/site run "profile-$BASE" 150 python \
  profile_step.py --tokens 1,8,64 --out "$OUT/profile-$BASE.json")
run kda-stage 60 python benchmarks/kda_stage.py --tokens 1,8,64 --out "$OUT/kda-stage.json"
elif [ "${PART:-1}" = 12 ]; then
# The engine's startup warm-up: its time and kernel variants, then whether the requests' steps still load any.
run engine-steps ${LIMIT:-200} python benchmarks/engine_steps.py --concurrency 16 --gen 4 --out "$OUT/engine-steps.json"
elif [ "${PART:-1}" = 15 ]; then
run dsa-tests 150 python -m pytest -q -m gpu -rfE --tb=short tests/test_kernels_dsa.py
run dsa-select 120 python benchmarks/dsa_select.py ${DSA_SELECT_ARGS:-} --out "$OUT/dsa-select.json"
PYTHONPATH=benchmarks/.b/$BASE:${PYTHONPATH#.:} run "dsa-select-$BASE" 120 python benchmarks/dsa_select.py ${DSA_SELECT_ARGS:-} \
  --out "$OUT/dsa-select-$BASE.json"
run dsa-stage 100 python benchmarks/dsa_stage.py --contexts 8192,131072 --tokens 1,2,8,16,64 --verify "" --no-stock \
  --out "$OUT/dsa-stage.json"
PYTHONPATH=benchmarks/.b/$BASE:${PYTHONPATH#.:} run "dsa-stage-$BASE" 100 python benchmarks/dsa_stage.py \
  --contexts 8192,131072 --tokens 1,2,8,16,64 --verify "" --no-stock --out "$OUT/dsa-stage-$BASE.json"
elif [ "${PART:-1}" = 19 ]; then
# The MoE's shared expert beside the routing in the step: its GPU tests, the executor's, the stage's plan variants,
# and the step's profile here and on the package of commit $BASE unpacked in benchmarks/.b/$BASE (as PART=9 says).
run moe-side-tests 200 python -m pytest -q -m gpu -rfE --tb=short tests/test_kernels_moe.py tests/gpu/test_specialized.py
run moe-side ${MOE_LIMIT:-120} python benchmarks/moe_stage.py --no-peer --tokens ${MOE_TOKENS:-1,2,4,8} --variants \
  --fields shared_side --plans "${MOE_PLANS:-}" --out "$OUT/moe-side.json"
run profile 150 python benchmarks/profile_step.py --tokens 1,2,4,8 --out "$OUT/profile.json"
(cd "benchmarks/.b/$BASE" && cp ../../profile_step.py . && PYTHONPATH=.:/tmp/site run "profile-$BASE" 150 python \
  profile_step.py --tokens 1,2,4,8 --out "$OUT/profile-$BASE.json")
elif [ "${PART:-1}" = 20 ]; then
run stage-tests 170 python -m pytest -q -m gpu -rfE --tb=short tests/test_kernels_kda.py tests/test_kernels_moe.py \
  tests/test_kernels_dsa.py
run moe-stage 110 python benchmarks/moe_stage.py --tokens 1,2,4,8,16,32,64 --variants --fields shared_side \
  --out "$OUT/moe-stage.json"
run kda-stage 45 python benchmarks/kda_stage.py --tokens 1,2,4,8,16,32,64 --verify 16x4 --out "$OUT/kda-stage.json"
run dsa-stage 75 python benchmarks/dsa_stage.py --contexts 8192,131072 --tokens 1,2,4,8,16,32,64 --verify "" \
  --out "$OUT/dsa-stage.json"
run profile 90 python benchmarks/profile_step.py --tokens 1,2,8,64 --out "$OUT/profile.json"
(cd "benchmarks/.b/$BASE" && cp ../../profile_step.py . && PYTHONPATH=.:/tmp/site run "profile-$BASE" 80 python \
  profile_step.py --tokens 1,2,8,64 --out "$OUT/profile-$BASE.json")
elif [ "${PART:-1}" = 22 ]; then
run moe-stage 120 python benchmarks/moe_stage.py --tokens 1,2,4,8,16,32,64 --out "$OUT/moe-stage.json"
run kda-stage 60 python benchmarks/kda_stage.py --tokens 1,2,4,8,16,32,64 --verify 16x4 --out "$OUT/kda-stage.json"
run dsa-stage 90 python benchmarks/dsa_stage.py --contexts 8192,131072 --tokens 1,2,4,8,16,32,64 --verify "" \
  --out "$OUT/dsa-stage.json"
elif [ "${PART:-1}" = 29 ]; then
# s49's untimed one-token KDA form, re-applied first (git revert 6876cdf): the KDA and DSA GPU tests, then the stage here and on
# the package of BASE (the commit before it: git archive 6735f4e glm5next benchmarks | tar -x -C benchmarks/.b/6735f4e,
# its own benchmark).
run kda-tests 170 python -m pytest -q -m gpu -rfE --tb=short tests/test_kernels_kda.py tests/test_kernels_dsa.py
run kda-stage 70 python benchmarks/kda_stage.py --tokens 1,2,4,8,16,32,64 --verify 16x4 --out "$OUT/kda-stage.json"
(cd "benchmarks/.b/$BASE" && PYTHONPATH=.:/tmp/site run kda-stage-base 70 python benchmarks/kda_stage.py \
  --tokens 1,2,4,8,16,32,64 --verify 16x4 --out "$OUT/kda-stage-base.json")
# Plans over the hoisted reads (s48's sweep predates them): 8 warps (two a scheduler, half the state a thread) and 64
# columns at 1-8 rows.
run kda-plans 90 python benchmarks/kda_stage.py --tokens 1,2,4,8 --verify 4x4 --block-v 128,64 --warps 4,8 \
  --out "$OUT/kda-plans.json"
# The DSA reads beside the slot (re-applied: git revert 6346d69), kernel by kernel, here and on the package of BASE.
D=(--contexts 8192,131072 --tokens 1,2,8,64 --verify "" --no-stock --profile)
run dsa-reads 70 python benchmarks/dsa_stage.py "${D[@]}" --out "$OUT/dsa-reads.json"
(cd "benchmarks/.b/$BASE" && PYTHONPATH=.:/tmp/site run dsa-reads-base 70 python benchmarks/dsa_stage.py "${D[@]}" \
  --out "$OUT/dsa-reads-base.json")
# The value-up's K steps more or all in flight (DsaPlan.up_stages, re-applied: git revert bd5c815; 4 / 8 against 3).
run dsa-up-stages 90 python benchmarks/dsa_stage.py --contexts 8192,131072 --tokens 1,2,8,16,64 --verify "" --no-stock \
  --plans "up_stages=4;up_stages=8" --out "$OUT/dsa-up-stages.json"
elif [ "${PART:-1}" = 5 ]; then
run e2e 540 python -m glm5next.bench.cli --mode specialized --tokens 1,4,16,64 --concurrency 1,4,16,64 \
  --skip-eager --skip-graph --mixed-budgets 512,2048,8192 --out "$OUT/e2e.json"
elif [ "${PART:-1}" = 1 ]; then
run tests 150 python -m pytest -q -m gpu tests/test_kernels_kda.py tests/test_kernels_moe.py tests/test_kernels_dsa.py
run profile 150 python benchmarks/profile_step.py --tokens 1,8,64 --out "$OUT/profile.json"
run profile-128k 60 python benchmarks/profile_step.py --tokens 1,64 --context 131072 --out "$OUT/profile-128k.json"
run kda-stage 45 python benchmarks/kda_stage.py --tokens 1,8,64 --verify 2x4 --out "$OUT/kda-stage.json"
else
run moe-stage 60 python benchmarks/moe_stage.py --no-peer --tokens 1,2,4,8,64 --out "$OUT/moe-stage.json"
run dsa-stage 60 python benchmarks/dsa_stage.py --contexts 8192,131072 --tokens 1,8,64 --verify 2x4 --out "$OUT/dsa-stage.json"
run kda-prefill 90 python benchmarks/kda_prefill.py --out "$OUT/kda-prefill.json"
# The attention of a 2048-token prefill chunk at 8K context (a verify-shaped step of one row) and its tiles.
run dsa-prefill-attend 100 python benchmarks/dsa_stage.py --contexts 8192 --tokens 1 --verify 1x2048 --no-stock \
  --attend 64/32/8,64/64/8,32/64/8,32/32/4,16/64/4,16/32/4 --out "$OUT/dsa-prefill-attend.json"
run executor 240 python -m pytest -q -x -m gpu tests/gpu/test_specialized.py
fi

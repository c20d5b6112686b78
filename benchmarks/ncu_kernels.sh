#!/usr/bin/env bash
# Nsight Compute's details page (throughput, occupancy, stall reasons, local-memory traffic) for a few kernels of
# the stage benchmarks: the KDA decode kernel against fla's recurrence at 64 rows, the MoE expert launches at
# one token, the DSA attention's attend launch at 64 and one rows (8K context). Writes $OUT/ncu-*.txt (SOURCE=1: and
# each kernel's SASS with its sampled stalls, $OUT/ncu-*-sass.csv).
#     OUT=DIR [ONLY="kda-ours dsa-attend-64"] [KDA_ROWS=1] [SOURCE=1] bash benchmarks/ncu_kernels.sh
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
profile() {  # name, kernel regex, launches to skip, launches to profile, command...
  local name=$1 regex=$2 skip=$3 count=$4; shift 4
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
  timeout 240 "$ncu" --clock-control none --set full -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    -f -o "/tmp/$name" "$@" > "/tmp/$name.log" 2>&1
  echo "=== $name: rc=$?"; tail -n 3 "/tmp/$name.log"
  "$ncu" -i "/tmp/$name.ncu-rep" --page details > "$OUT/ncu-$name.txt" 2>&1
  # SOURCE=1: also the SASS with each instruction's sampled warp stalls (where a latency-bound kernel waits)
  [ "${SOURCE:-0}" = 1 ] && "$ncu" -i "/tmp/$name.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/ncu-$name-sass.csv" 2>&1
}
profile kda-ours 'kda_decode_kernel' ${KDA_SKIP:-3} 1 python benchmarks/kda_stage.py --tokens ${KDA_ROWS:-64} --verify ""
profile kda-fla 'fused_recurrent_kda_fwd_kernel' ${FLA_SKIP:-3} 1 python benchmarks/kda_stage.py --tokens ${KDA_ROWS:-64} --verify ""
profile moe-m1 'gate_up_kernel|down_kernel' ${MOE_SKIP:-4} 2 python benchmarks/moe_stage.py --tokens 1 --no-peer
dsa=(python benchmarks/dsa_stage.py --contexts 8192 --verify "" --no-stock)
profile dsa-attend-64 'attend_kernel' ${DSA_SKIP:-3} 1 "${dsa[@]}" --tokens 64
profile dsa-attend-1 'attend_kernel' ${DSA_SKIP:-3} 1 "${dsa[@]}" --tokens 1

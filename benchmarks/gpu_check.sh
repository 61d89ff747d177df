#!/usr/bin/env bash
# The GPU check: tpulab's claims run on an NVIDIA GPU, as one prepared script (about 6 min on an H200 before the
# decode512 and serve stages, which add about 2-3 min).
#
#   OUT=results_dir [PY=python3] [SIZE=full|tiny] [BUDGET=seconds] [STAGES="proof bench ..."] bash benchmarks/gpu_check.sh
#
# Stages (each in its own processes, each time-limited, each logged; a failing stage does not stop the rest):
#   env       what the host and JAX report (nvidia-smi, jax.devices(), versions)
#   receipt   tpulab receipt --expect gpu --expect-devices 1 (collective, timed matmul, round trip)
#   proof     prove-resume on the default config with deterministic GPU ops: SIGKILL'd, resumed in a fresh
#             process, curves and the whole final state compared bitwise with an uninterrupted reference
#   chaos     5 SIGKILLs at random moments, whole-state verdict against the reference
#   export    export the proof run's endpoints (cpu, tpu, cuda) of the reference run, verify them on this GPU, generate from them
#   bench     synchronized steady-state step time and utilization, sweep over d_model
#   profile   a trace of 5 warmed steps (ops launched one by one, no CUDA graph) and its top-ops table
#   decode    benchmarks/decode_speed.py on the proof run (compiled loop vs step loop vs recompute; batch table)
#   decode512 the measuring point: a max_seq_len 512 model (20 steps), 448 + 64 and 64 + 64 tokens
#   serve     tpulab serve-bench on the exported endpoints (needs export): serial vs batching server, 1/4/8/16 clients
#   sft       prove-resume of SFT (objective.kind=sft, response-only loss) from the proof's reference run, deterministic ops
#   lora      the same with LoRA adapters (rank 8): adapters, their Adam moments and the data position bitwise
#   proof_nd  the proof without --xla_gpu_deterministic_ops (is the GPU bitwise resumable without it?)
# Everything lands in $OUT/gpu_check.tar.gz; $OUT/summary.txt has one line per stage (rc, seconds).
set -u
OUT=${OUT:?set OUT to a results directory}
PY=${PY:-python3}
W=${WORK:-/tmp/tpulab-gpu}
SIZE=${SIZE:-full}
BUDGET=${BUDGET:-3600}  # seconds for all stages together: a stage gets at most what is left, none under 30 s
END=$(( $(date +%s) + BUDGET ))
rm -rf "$W" && mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # proofs run several JAX processes on the one GPU
export TPULAB_COMPILE_CACHE="$W/jax-cache"
T="$PY -m tpulab.cli"
DET="--xla_gpu_deterministic_ops=true"
if [ "$SIZE" = tiny ]; then  # a smoke test of this script on any host (CPU included)
  CFG="--config configs/tiny.yaml"; STEPS=40; SWEEP=model.d_model=32,64; KILLS=2; GEN=16; SERVE_NEW=16
else
  CFG=""; STEPS=300; SWEEP=model.d_model=128,256,512,1024; KILLS=5; GEN=64; SERVE_NEW=32
fi

stage() {  # stage NAME LIMIT_S CMD...: run, log to $W/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  case " ${STAGES:-$name} " in *" $name "*) ;; *) return ;; esac
  local left=$(( END - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "$name     skipped (budget spent)" | tee -a "$W/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s%N)
  timeout -k 10 "$limit" bash -c "$*" >"$W/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%-9s rc=%-3s %5d.%01ds\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) | tee -a "$W/summary.txt"
  tail -n 4 "$W/$name.log" | sed 's/^/    /'
}

stage env 120 "nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  $PY -c 'import jax, jaxlib, flax, optax, orbax.checkpoint as o, grain, numpy, sys; print(sys.version);
print(jax.devices(), jax.default_backend()); print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\",
flax.__version__, \"optax\", optax.__version__, \"orbax\", o.__version__, \"numpy\", numpy.__version__)'"
stage receipt 180 "$T receipt --out $W/receipt --expect gpu --expect-devices 1"
stage proof 420 "XLA_FLAGS=$DET $T prove-resume --run-dir $W/proof $CFG --steps $STEPS"
stage chaos 420 "XLA_FLAGS=$DET $T chaos --run-dir $W/chaos $CFG --steps $STEPS --kills $KILLS"
stage export 300 "$T export --run-dir $W/proof/proof/reference --out $W/export &&
  $T verify-export $W/export --run-dir $W/proof/proof/reference &&
  $T generate --artifacts $W/export --run-dir $W/proof/proof/reference --prompt 'ROMEO:' --max-new $GEN &&
  $T generate --run-dir $W/proof/proof/reference --prompt 'ROMEO:' --max-new $GEN"
stage bench 420 "$T bench --run-dir $W/bench $CFG --set model.dropout=0 --sweep $SWEEP"
stage profile 180 "XLA_FLAGS=--xla_gpu_enable_command_buffer= $T profile --run-dir $W/proof/proof/reference --steps 5 &&
  $PY benchmarks/xplane_planes.py \$(ls -t \$(find $W/proof/proof/reference/profile -name '*.xplane.pb') | head -1)"
stage decode 300 "$PY benchmarks/decode_speed.py --run-dir $W/proof/proof/reference --out $W/decode_speed"
stage decode512 300 "$T train --run-dir $W/s512 $CFG --set model.max_seq_len=512 --steps 20 --no-progress --no-track &&
  $PY benchmarks/decode_speed.py --run-dir $W/s512 --prompt-lens 448 64 --new-tokens 64 --batches 1 8 32 --out $W/decode_speed_s512"
stage serve 300 "$T serve-bench --artifacts $W/export --out $W/serve_bench --clients 1 4 8 16 --requests 30 --max-new $SERVE_NEW"
SFT="--set objective.kind=sft --set objective.init=$W/proof/proof/reference"
stage sft 300 "XLA_FLAGS=$DET $T prove-resume --run-dir $W/sft $CFG $SFT --steps $((STEPS / 3))"
stage lora 300 "XLA_FLAGS=$DET $T prove-resume --run-dir $W/lora $CFG $SFT --set objective.lora.rank=8 --steps $((STEPS / 3))"
stage proof_nd 300 "$T prove-resume --run-dir $W/proof_nd $CFG --steps $STEPS"

# Results: logs, verdicts, receipts, bench/profile tables, decode and serve tables; no checkpoints, no traces, no cache.
(cd "$W" && tar czf "$OUT/gpu_check.tar.gz" --exclude='checkpoints' --exclude='jax-cache' --exclude='*.xplane.pb' \
  --exclude='*.trace.json.gz' --exclude='weights.npz' --exclude='*.bin' --exclude='rejected_checkpoints' .)
cp "$W/summary.txt" "$OUT/summary.txt"
ls -la "$OUT"

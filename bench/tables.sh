#!/usr/bin/env bash
# Every table of docs/benchmarks.md from one commit, on a quiet machine, one command after another
# (nothing else may run meanwhile: on 2 cores any other process skews every number). Each command's
# output goes to OUT/NAME.txt; the sweep rewrites the first half of benchmarks.md itself, and each
# other step's output is written between its markers there by `python -m bench.tables_doc OUT STEP`
# (with the command, commit, date and CPU), the prose around the markers kept.
#
#     bash bench/tables.sh /tmp/tables            # everything (hours on a small machine)
#     bash bench/tables.sh /tmp/tables targets    # only the steps named
set -euo pipefail
OUT=${1:?usage: bench/tables.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
GGUF=$(python -c "from gpu_worker.weights.model_files import embedded_gguf_path as p; print(p())")
KIND=$(python -c "from gpu_worker.backends.cpu.kind import requested_kind as k; print(k().value)")
LLAMA=$(python -m bench.llama_cpp path --kind "$KIND" || true)

declare -A STEPS=(
  [sweep]="python -m bench.sweep --peer 'rivulet over HTTP=python launcher.py --http-port {port} --endpoint ipc://$OUT/http/client.sock' ${LLAMA:+--peer 'llama.cpp=$LLAMA -m $GGUF --port {port} -np 32 -c 8192 -t $(nproc)'} --manifest $OUT/sweep.json --records $OUT/sweep.jsonl"
  [targets]="python -m bench.targets --dtype auto --repeats 3 --peer-llama-cpp auto --hf-dtype float32 --offline-prompts 128 --hf-batch-sizes 32 --idle-s 3"
  [matmul_paths]="python -m bench.matmul_paths --repeats 3"
  [quant_matmul]="python -m bench.quant_matmul --types q4_1,q8_0,q4_0 --rows 1,2,4,8,16,32,64,256 --repeats 3"
  [quant_k]="python -m bench.quant_matmul --types q4_k,q5_k,q6_k --shapes 1024x768,768x1536,3072x768 --rows 16,32,64 --repeats 3 --no-head"
  [one_call]="python -m bench.worker_step --dtype float32:gguf,float32:gguf-modules,bfloat16:gguf,bfloat16:gguf-modules --decode-batches 1,32 --prefill 0 --rounds 3 --iters 20"
  [dense_kernels]="python -m bench.worker_step --dtype bfloat16,bfloat16:torch --rounds 3"
  [weight_memory]="python -m bench.weight_memory"
  [choices]="python -m bench.choices --rounds 3"
  [grammar_cost]="python -m bench.grammar_cost"
  [dp_routing]="python -m bench.dp_routing --part routing --rounds 1 && python -m bench.dp_routing --part streams --rounds 2"
  [tp_step]="python -m bench.tp_step --rounds 3 --iters 10"
)
ORDER=(sweep targets matmul_paths quant_matmul quant_k one_call dense_kernels weight_memory choices grammar_cost dp_routing tp_step)
[ $# -gt 0 ] || set -- "${ORDER[@]}"
for step in "$@"; do
  echo "== $step: ${STEPS[$step]}" | tee "$OUT/$step.txt"
  (eval "${STEPS[$step]}") >> "$OUT/$step.txt" 2>&1 || echo "!! $step failed" | tee -a "$OUT/$step.txt"
  echo "$(git rev-parse --short HEAD) $(date -u +%FT%TZ) $step done" >> "$OUT/done.txt"
  [ "$step" = sweep ] || python -m bench.tables_doc "$OUT" "$step"
done

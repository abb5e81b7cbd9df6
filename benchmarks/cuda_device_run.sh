#!/usr/bin/env bash
# What one lent GPU machine runs (device tool), in the stages named (default: eager probe):
#   eager     benchmarks/cuda_validation.py measure on the plans made on the CPU host (benchmarks/cuda_plans)
#   probe     benchmarks/cuda_probe.py: the per-op allocator log against sacplan's tracker
#   compiled  the llama-1b plans again with compiled blocks
# It first installs the wheels the image lacks (.whl, carried). Results land in $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, timm, torchvision; print('torch', torch.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__)"
quiet() { grep -v -i -E "warn|loss_type" ; }
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(eager probe)
for stage in "${stages[@]}"; do
  case $stage in
    eager) timeout "${EAGER_S:-300}" python3 benchmarks/cuda_validation.py measure --jsonl "$OUT/cuda_validation.jsonl" 2>&1 | quiet > "$OUT/measure.log" ;;
    probe) timeout "${PROBE_S:-120}" python3 benchmarks/cuda_probe.py --cases gpt2 vit-b16 resnet50 --out "$OUT" 2>&1 | quiet | tee "$OUT/probe.log" ;;
    compiled) timeout "${COMPILED_S:-150}" python3 benchmarks/cuda_validation.py measure --cases llama-1b --compile --jsonl "$OUT/cuda_compiled.jsonl" 2>&1 | quiet > "$OUT/compiled.log" ;;
  esac
done
for f in cuda_validation cuda_compiled; do
  [ -f "$OUT/$f.jsonl" ] && python3 benchmarks/cuda_validation.py report --jsonl "$OUT/$f.jsonl"
done
exit 0

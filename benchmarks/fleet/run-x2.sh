#!/usr/bin/env bash
# What ran on the 2×H200 machine for benchmarks/RESULTS.md ("Fleet sweeps"). $OUT collects logs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/aegis-x2-out}
mkdir -p /tmp/aegis-x2 "$OUT"
python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
python3 -c 'from aegis_cli.backends import cuda_available; print("aegis cuda backend available:", cuda_available())' 2>&1 | tail -2
for run in clean inject; do
  t0=$(date +%s.%N)
  torchrun --nproc-per-node 2 -m aegis_cli sweep --config benchmarks/fleet/x2-$run.yaml --format none > "$OUT/$run.log" 2>&1
  rc=$?
  echo "run=$run exit=$rc wall_s=$(python3 -c "import time; print(round(time.time() - $t0, 2))")"
  grep -E "event=(comparison|device_done|device_timeout|device_failed|fleet_report)" "$OUT/$run.log" | cut -c1-220
  cp /tmp/aegis-x2/fleet-$run.json "$OUT/" 2>/dev/null
done
cp /tmp/aegis-x2/aegis.prom /tmp/aegis-x2/quarantine.tsv "$OUT/" 2>/dev/null
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/fleet-*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], d["outcome"], "exit", d["exit_code"], d["distributed"],
          [(x["device"]["id"], x["device"]["name"], x["verdict"], x["local_verdict"], x["timings"]["seconds"]) for x in d["devices"]])
PY

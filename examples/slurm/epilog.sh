#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/aegis.sh): a short sweep after each job.
# It runs in the foreground: Slurm keeps the node COMPLETING until the epilog returns, so the
# next job cannot start on GPUs the sweep still uses (in the background it shared them with that
# job: both slower, and out of memory on either side). AEGIS_EPILOG_TIMEOUT (seconds, default
# 300) bounds it; keep Slurm's PrologEpilogTimeout above it. A sweep stopped by the limit records
# nothing. The epilog exits 0 whatever the sweep found: a failing epilog drains the node, and
# draining is for the sweep's actions to decide. While another sweep holds the node's lock (a
# cron one), this one exits at once. AEGIS_BIN / AEGIS_CONFIG / AEGIS_EPILOG_LOG override (tests).
aegis=${AEGIS_BIN:-/usr/local/bin/aegis}
config=${AEGIS_CONFIG:-/etc/aegis/sweep-epilog.yaml}
log=${AEGIS_EPILOG_LOG:-/var/log/aegis-epilog.log}
limit=${AEGIS_EPILOG_TIMEOUT:-300}
timeout -k 10 "$limit" "$aegis" sweep --config "$config" --log-format logfmt >>"$log" 2>&1 </dev/null
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "aegis epilog: sweep stopped after ${limit} s" >>"$log"
fi
exit 0

#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/aegis.sh): a short sweep after each
# job, in the background so the node is released at once; the sweep's lock makes a second
# epilog exit 3 instead of stacking sweeps. AEGIS_BIN / AEGIS_CONFIG override (tests).
aegis=${AEGIS_BIN:-/usr/local/bin/aegis}
config=${AEGIS_CONFIG:-/etc/aegis/sweep-epilog.yaml}
nohup "$aegis" sweep --config "$config" --log-format logfmt >>/var/log/aegis-epilog.log 2>&1 </dev/null &
exit 0

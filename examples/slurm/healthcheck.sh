#!/bin/sh
# Slurm HealthCheckProgram (slurm.conf: HealthCheckProgram=/etc/slurm/aegis-healthcheck.sh,
# HealthCheckInterval=300): drains this node while aegis holds one of its GPUs in quarantine,
# using the list the last sweep wrote (cheap: no GPU work here). AEGIS_QUARANTINE_LIST overrides.
list=${AEGIS_QUARANTINE_LIST:-/var/lib/aegis/quarantine.tsv}
host=$(hostname -s)
[ -f "$list" ] || exit 0
devs=$(grep -v '^#' "$list" | awk -F '\t' -v h="$host" '$3 == h || $3 ~ "^"h"\\." { printf "%s%s", sep, $4; sep="," }')
if [ -n "$devs" ]; then
  exec scontrol update NodeName="$host" State=DRAIN Reason="AEGIS: quarantined $devs"
fi
exit 0

#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/aegis.sh): refuse to start a job on a
# node with a quarantined GPU. A non-zero exit drains the node (Slurm's own behaviour).
# AEGIS_QUARANTINE_LIST overrides the list's path (tests).
list=${AEGIS_QUARANTINE_LIST:-/var/lib/aegis/quarantine.tsv}
[ -f "$list" ] || exit 0
host=$(hostname -s)
if grep -v '^#' "$list" | awk -F '\t' -v h="$host" '$3 == h || $3 ~ "^"h"\\." { found=1 } END { exit !found }'; then
  echo "aegis: $host has a quarantined GPU (see $list)" >&2
  exit 1
fi
exit 0

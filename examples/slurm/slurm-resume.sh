#!/bin/sh
# aegis on_readmit action: resume this Slurm node — only if aegis drained it (Reason starts
# with "AEGIS:"); a node drained by anyone else for any other reason is left alone.
# usage: slurm-resume.sh NODE
set -eu
node=$1
reason=$(scontrol show node "$node" | sed -n 's/.*Reason=\(.*\)/\1/p' | head -n 1)
case "$reason" in
  AEGIS:*) exec scontrol update NodeName="$node" State=RESUME ;;
  *) echo "aegis: not resuming $node: it was not drained by aegis (Reason=${reason:-none})" >&2; exit 0 ;;
esac

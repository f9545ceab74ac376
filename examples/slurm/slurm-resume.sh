#!/bin/sh
# aegis on_readmit action: resume this Slurm node — only if aegis drained it (Reason starts
# with "AEGIS:"); a node drained by anyone else for any other reason is left alone.
# Not while other GPUs of the node are still quarantined (aegis passes how many as the 2nd arg).
# usage: slurm-resume.sh NODE [OTHERS_STILL_QUARANTINED]
set -eu
node=$1
others=${2:-0}
if [ "$others" != 0 ]; then
  echo "aegis: not resuming $node: $others other GPU(s) on it still quarantined" >&2
  exit 0
fi
reason=$(scontrol show node "$node" | sed -n 's/.*Reason=\(.*\)/\1/p' | head -n 1)
case "$reason" in
  AEGIS:*) exec scontrol update NodeName="$node" State=RESUME ;;
  *) echo "aegis: not resuming $node: it was not drained by aegis (Reason=${reason:-none})" >&2; exit 0 ;;
esac

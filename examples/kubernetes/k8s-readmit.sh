#!/bin/sh
# aegis on_readmit action for Kubernetes: lift aegis's taint; uncordon only a node that
# carries aegis's annotation (never one cordoned by someone else).
# Not while other GPUs of the node are still quarantined (aegis passes how many as the 2nd arg).
# usage: k8s-readmit.sh NODE [OTHERS_STILL_QUARANTINED]
set -eu
node=$1
others=${2:-0}
if [ "$others" != 0 ]; then
  echo "aegis: not uncordoning $node: $others other GPU(s) on it still quarantined" >&2
  exit 0
fi
mark=$(kubectl get node "$node" -o jsonpath='{.metadata.annotations.aegis\.dev/quarantined}')
if [ -z "$mark" ]; then
  echo "aegis: not uncordoning $node: aegis did not cordon it" >&2
  exit 0
fi
kubectl taint nodes "$node" aegis.dev/sdc=quarantined:NoSchedule-
kubectl annotate nodes "$node" aegis.dev/quarantined-
exec kubectl uncordon "$node"

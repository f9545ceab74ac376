#!/bin/sh
# aegis on_quarantine action for Kubernetes: taint and cordon the node.
# usage: k8s-quarantine.sh NODE UUID REASON
set -eu
node=$1 uuid=$2 reason=$3
kubectl taint nodes "$node" aegis.dev/sdc=quarantined:NoSchedule --overwrite
kubectl annotate nodes "$node" aegis.dev/quarantined="$uuid: $reason" --overwrite
exec kubectl cordon "$node"

#!/bin/sh
# aegis on_quarantine action: drain this Slurm node. Reason is prefixed "AEGIS:" so that
# slurm-resume.sh only ever resumes nodes aegis drained.
# usage: slurm-drain.sh NODE DEVICE UUID REASON
set -eu
node=$1 device=$2 uuid=$3 reason=$4
exec scontrol update NodeName="$node" State=DRAIN Reason="AEGIS: $device $uuid $reason"

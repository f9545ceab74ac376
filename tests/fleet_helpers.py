"""Shared pieces of the fleet tests: a tiny workload and sweep configs in a temp folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = """\
name: fleet-tiny
model: {hidden: 64, ffn: 128, heads: 2, kv_heads: 1, seq_len: 64, micro_batch: 1, tp: 1}
scan: {ops: [mlp_down], layouts: [fwd], distributions: [normal], scales: [[0, 0], [-8, 8]]}
"""


def write_config(tmp: Path, **over) -> Path:
    (tmp / "wl.yaml").write_text(WORKLOAD, encoding="utf-8")
    cfg = {"devices": "cpu", "workload": "wl.yaml", "reruns": 2, "budget_seconds": 60, "device_timeout_seconds": 30,
           "lock_file": "sweep.lock", "history": {"path": "history.sqlite"},
           "exports": {"report": "report.json", "quarantine_list": "quarantine.tsv", "prometheus_textfile": "aegis.prom"}}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def env(n_devices: int = 3, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "SLURM_PROCID")}
    e.update({"AEGIS_CPU_DEVICES": str(n_devices), "PYTHONPATH": str(REPO), **extra})
    return e


def aegis(*args: str, **kw) -> list[str]:
    return [sys.executable, "-m", "aegis_cli", *args]


def start_sweep(config: Path, n_devices: int = 3) -> subprocess.Popen:
    return subprocess.Popen(aegis("sweep", "--config", str(config)), env=env(n_devices), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=config.parent)


def wait_for(pred, timeout: float = 30.0, step: float = 0.1) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(step)
    return False

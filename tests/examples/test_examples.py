"""Every file in examples/ is exercised: configs parse into the real dataclasses, shell
scripts run (dry) against fake scontrol/kubectl, manifests and units parse."""

from __future__ import annotations

import configparser
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from aegis_cli.fleet.actions import ActionsConfig, render_argv
from aegis_cli.fleet.config import load_config

EX = Path(__file__).resolve().parents[2] / "examples"
FAKE = """#!/bin/sh
printf '%s\\n' "$(basename "$0") $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show node") echo "NodeName=$3 State=DRAINED Reason=${FAKE_REASON:-none} [root@2026]" ;;
  "get node") printf '%s' "${FAKE_ANNOTATION:-}" ;;
esac
"""


def test_every_example_is_covered():
    covered = {"sweep.yaml", "crontab", "systemd/aegis-sweep.service", "systemd/aegis-sweep.timer", "slurm/slurm-drain.sh",
               "slurm/slurm-resume.sh", "slurm/prolog.sh", "slurm/epilog.sh", "slurm/healthcheck.sh", "slurm/torchrun-sweep.sbatch",
               "kubernetes/k8s-quarantine.sh", "kubernetes/k8s-readmit.sh", "kubernetes/cronjob.yaml", "kubernetes/daemonset.yaml",
               "train_gpt/README.md", "train_gpt/gpt.py", "train_gpt/train.py"}  # train_gpt: tests/sensors/test_training.py
    found = {str(p.relative_to(EX)) for p in EX.rglob("*") if p.is_file() and "__pycache__" not in p.parts}  # train_gpt is imported
    assert found == covered, f"examples without a test: {found - covered}; tests without a file: {covered - found}"


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("scontrol", "kubectl"):
        (bin_ / name).write_text(FAKE)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    return lambda: log.read_text().splitlines() if log.exists() else []


def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(EX / script), *args], capture_output=True, text=True, timeout=30, env={**os.environ, **env})


def test_sample_sweep_yaml_parses_with_every_option():
    cfg = load_config(EX / "sweep.yaml")
    assert cfg.policy.probation_sweeps == 5 and cfg.actions.enabled is False and cfg.history.path.endswith("history.sqlite")
    text = (EX / "sweep.yaml").read_text()
    from dataclasses import fields

    from aegis_cli.fleet.config import SweepConfig

    for f in fields(SweepConfig):
        if f.name != "source" and f.init:  # init=False: set by the sweep, no option
            assert f"\n{f.name}:" in text, f"examples/sweep.yaml does not show option {f.name}"
    argv = render_argv(cfg.actions.on_quarantine, {"uuid": "GPU-1", "serial": "", "host": "n1.x", "host_short": "n1", "device": "cuda:3",
                                                   "index": "3", "name": "H200", "state": "QUARANTINED", "reason": "FAULTY 1×", "event": "quarantine"})
    assert argv == ["/usr/local/lib/aegis/slurm-drain.sh", "n1", "cuda:3", "GPU-1", "FAULTY 1×"]


def test_slurm_drain_prefixes_reason(fakes):
    p = run("slurm/slurm-drain.sh", "n1", "cuda:3", "GPU-1", "FAULTY 1× (gemm.row_checksum)")
    assert p.returncode == 0, p.stderr
    assert fakes() == ["scontrol update NodeName=n1 State=DRAIN Reason=AEGIS: cuda:3 GPU-1 FAULTY 1× (gemm.row_checksum)"]


def test_slurm_resume_only_resumes_what_aegis_drained(fakes):
    p = run("slurm/slurm-resume.sh", "n1", FAKE_REASON="maintenance by admin")
    assert p.returncode == 0 and "not resuming n1" in p.stderr
    assert fakes() == ["scontrol show node n1"]
    p = run("slurm/slurm-resume.sh", "n1", FAKE_REASON="AEGIS: cuda:3 GPU-1 FAULTY")
    assert p.returncode == 0 and fakes()[-1] == "scontrol update NodeName=n1 State=RESUME"


def test_slurm_prolog_and_healthcheck_read_the_quarantine_list(fakes, tmp_path):
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    q = tmp_path / "quarantine.tsv"
    q.write_text("# header\n# uuid\tserial\thost\tdevice\tstate\tsince\tclean_streak\treason\n"
                 "GPU-9\t\tother-node\tcuda:0\tQUARANTINED\t\t0\tx\n")
    assert run("slurm/prolog.sh", AEGIS_QUARANTINE_LIST=str(q)).returncode == 0
    assert run("slurm/healthcheck.sh", AEGIS_QUARANTINE_LIST=str(q)).returncode == 0 and fakes() == []
    q.write_text(q.read_text() + f"GPU-1\t\t{host}\tcuda:3\tQUARANTINED\t\t0\tFAULTY 1×\n")
    p = run("slurm/prolog.sh", AEGIS_QUARANTINE_LIST=str(q))
    assert p.returncode == 1 and "quarantined GPU" in p.stderr
    assert run("slurm/healthcheck.sh", AEGIS_QUARANTINE_LIST=str(q)).returncode == 0
    assert fakes() == [f"scontrol update NodeName={host} State=DRAIN Reason=AEGIS: quarantined cuda:3"]


def test_slurm_epilog_sweeps_before_the_node_is_released(tmp_path):
    """The epilog returns only when its sweep has finished (Slurm starts no job on the node
    until then), exits 0 whatever the sweep found (a failing epilog drains the node), and a
    sweep over its time limit is stopped and logged."""
    import time

    fake = tmp_path / "aegis"
    out, log = tmp_path / "args", tmp_path / "epilog.log"
    fake.write_text(f"#!/bin/sh\nsleep ${{FAKE_SLEEP:-1}}\necho \"$@\" > {out}\nexit 2\n")
    fake.chmod(0o755)
    p = run("slurm/epilog.sh", AEGIS_BIN=str(fake), AEGIS_CONFIG="/etc/aegis/x.yaml", AEGIS_EPILOG_LOG=str(log))
    assert p.returncode == 0 and out.exists()  # done before the epilog returned
    assert out.read_text().split() == ["sweep", "--config", "/etc/aegis/x.yaml", "--log-format", "logfmt"]
    out.unlink()
    t0 = time.monotonic()
    p = run("slurm/epilog.sh", AEGIS_BIN=str(fake), AEGIS_CONFIG="/x.yaml", AEGIS_EPILOG_LOG=str(log), FAKE_SLEEP="60",
            AEGIS_EPILOG_TIMEOUT="1")
    assert p.returncode == 0 and time.monotonic() - t0 < 20 and not out.exists()
    assert "aegis epilog: sweep stopped after 1 s" in log.read_text()


def test_sbatch_script_syntax_and_launch_line():
    text = (EX / "slurm/torchrun-sweep.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(EX / "slurm/torchrun-sweep.sbatch")]).returncode == 0
    assert "-m aegis_cli sweep --config" in text and "MASTER_ADDR" in text


def test_k8s_actions_taint_cordon_and_readmit_only_their_own(fakes):
    assert run("kubernetes/k8s-quarantine.sh", "n1", "GPU-1", "FAULTY 1×").returncode == 0
    assert fakes() == ["kubectl taint nodes n1 aegis.dev/sdc=quarantined:NoSchedule --overwrite",
                       "kubectl annotate nodes n1 aegis.dev/quarantined=GPU-1: FAULTY 1× --overwrite", "kubectl cordon n1"]
    p = run("kubernetes/k8s-readmit.sh", "n2")
    assert p.returncode == 0 and "did not cordon" in p.stderr and fakes()[-1].startswith("kubectl get node n2")
    assert run("kubernetes/k8s-readmit.sh", "n1", FAKE_ANNOTATION="GPU-1: FAULTY").returncode == 0
    assert fakes()[-3:] == ["kubectl taint nodes n1 aegis.dev/sdc=quarantined:NoSchedule-", "kubectl annotate nodes n1 aegis.dev/quarantined-",
                            "kubectl uncordon n1"]


@pytest.mark.parametrize("name", ["kubernetes/cronjob.yaml", "kubernetes/daemonset.yaml"])
def test_k8s_manifests_parse_and_embed_a_valid_config(name, tmp_path):
    docs = [d for d in yaml.safe_load_all((EX / name).read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds == (["CronJob", "ConfigMap"] if "cronjob" in name else ["DaemonSet"])
    pod = docs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"] if kinds[0] == "CronJob" else docs[0]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = " ".join(c.get("args", []))
    assert "sweep --config /etc/aegis/sweep.yaml" in cmd
    assert any(t["key"] == "aegis.dev/sdc" for t in pod["tolerations"])  # aegis keeps checking what it quarantined
    if kinds[0] == "CronJob":
        (tmp_path / "sweep.yaml").write_text(docs[1]["data"]["sweep.yaml"])
        cfg = load_config(tmp_path / "sweep.yaml")
        assert isinstance(cfg.actions, ActionsConfig) and cfg.actions.on_quarantine[0].endswith("k8s-quarantine.sh")
        assert docs[0]["spec"]["concurrencyPolicy"] == "Forbid"


def test_systemd_units_parse():
    svc = configparser.ConfigParser(strict=True, interpolation=None)
    svc.read(EX / "systemd/aegis-sweep.service")
    argv = shlex.split(svc["Service"]["ExecStart"])
    assert argv[1:4] == ["sweep", "--config", "/etc/aegis/sweep.yaml"] and svc["Service"]["Type"] == "oneshot"
    assert svc["Service"]["SuccessExitStatus"].split() == ["1", "2"]
    timer = configparser.ConfigParser(strict=True, interpolation=None)
    timer.read(EX / "systemd/aegis-sweep.timer")
    assert timer["Timer"]["OnCalendar"] and timer["Install"]["WantedBy"] == "timers.target"


def test_crontab_line():
    (line,) = [ln for ln in (EX / "crontab").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    fields = line.split(None, 6)
    assert len(fields) == 7 and fields[5] == "root"
    minute, hour = int(fields[0]), int(fields[1])
    assert 0 <= minute < 60 and 0 <= hour < 24 and fields[2:5] == ["*", "*", "*"]
    assert "aegis sweep --config /etc/aegis/sweep.yaml" in fields[6]


def test_scripts_are_executable():
    for p in EX.rglob("*.sh"):
        assert p.stat().st_mode & stat.S_IXUSR, p
        assert subprocess.run(["sh", "-n", str(p)]).returncode == 0, p

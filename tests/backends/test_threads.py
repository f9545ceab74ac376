"""The thread policy of aegis commands (backends/threads.py)."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends import threads
from aegis_cli.ops.errors import ConfigError


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_default_is_half_the_usable_cores(monkeypatch):
    for cores, want in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (128, threads.MAX_DEFAULT)):
        monkeypatch.setattr(threads, "usable_cores", lambda cores=cores: cores)
        assert threads.chosen_threads({}) == want


def test_aegis_threads_wins_and_omp_num_threads_is_left_to_torch(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 64)
    assert threads.chosen_threads({"AEGIS_THREADS": "3", "OMP_NUM_THREADS": "1"}) == 3
    assert threads.chosen_threads({"OMP_NUM_THREADS": "2"}) is None


@pytest.mark.parametrize("bad", ["0", "-2", "many", "1.5"])
def test_a_bad_aegis_threads_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="AEGIS_THREADS"):
        threads.chosen_threads({"AEGIS_THREADS": bad})


def test_sweep_workers_divide_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert [threads.share(n, {}) for n in (1, 2, 4, 8, 32)] == [8, 8, 4, 2, 1]
    assert threads.share(8, {"AEGIS_THREADS": "5"}) == 5


def test_apply_sets_torch_threads(restore_threads):
    assert threads.apply_thread_policy({"AEGIS_THREADS": "1"}) == 1 == torch.get_num_threads()
    torch.set_num_threads(2)
    assert threads.apply_thread_policy({"OMP_NUM_THREADS": "2"}) == 2  # left as torch has it


def test_sweep_workers_get_their_share_unless_the_operator_set_a_count(monkeypatch):
    from aegis_cli.fleet import workers

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.delenv("AEGIS_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert workers._worker_env(None, 4)["AEGIS_THREADS"] == "4"
    assert workers._worker_env({"AEGIS_THREADS": "2"}, 4)["AEGIS_THREADS"] == "2"
    assert "AEGIS_THREADS" not in workers._worker_env({"OMP_NUM_THREADS": "3"}, 4)


def test_the_scan_command_applies_the_policy(tmp_path, restore_threads):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "r.json"
    env = {**os.environ, "AEGIS_THREADS": "1"}
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([sys.executable, "-m", "aegis_cli", "scan", "-q", "--probes", "gemm", "--format", "json", "-o", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["devices"][0]["device"]["extra"]["threads"] == "1"
    bad = subprocess.run([sys.executable, "-m", "aegis_cli", "scan", "-q"], capture_output=True, text=True, timeout=300,
                         env={**env, "AEGIS_THREADS": "lots"})
    assert bad.returncode == 3 and bad.stderr.strip().splitlines()[-1] == "Error: AEGIS_THREADS must be a positive integer, got 'lots'"

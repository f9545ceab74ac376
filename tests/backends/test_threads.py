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

"""Sweep configs and workload catalogs at their edges: alias bombs, numbers YAML 1.1 reads as
strings, values past any sensible duration, format strings that do not parse, the lock named
as the history. Each is one line naming file and line, exit 3, at once."""

from __future__ import annotations

import subprocess
import time

import pytest

from aegis_cli.fleet.config import load_config
from aegis_cli.ops import config, workloads
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import aegis, env, write_config


def alias_bomb(levels: int = 9, width: int = 9, first_key: str = "a") -> str:
    """Each level a list holding the previous one ``width`` times: width**levels values."""
    lines = [f"{first_key}: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
    return lines[0]


def test_alias_bomb_in_a_sweep_config_is_refused_quickly(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(alias_bomb(first_key="devices"), encoding="utf-8")
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"sweep\.yaml: line \d+: malformed YAML: aliases expand to over"):
        load_config(path)
    assert time.monotonic() - start < 10
    line = one_error_line(subprocess.run(aegis("sweep", "--config", str(path)), env=env(1), capture_output=True,
                                         text=True, timeout=60))
    assert "alias bomb" in line


def test_alias_bomb_in_a_workload_is_refused_quickly(tmp_path):
    path = tmp_path / "wl.yaml"
    path.write_text(alias_bomb(first_key="name"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"wl\.yaml: line \d+: malformed YAML: aliases expand to over"):
        workloads.load(str(path))


def test_a_few_aliases_are_still_fine(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("base: &b {hidden: 64, ffn: 128}\none: *b\ntwo: *b\n", encoding="utf-8")
    data = config.load_yaml(path)
    assert data["one"] == data["two"] == {"hidden": 64, "ffn": 128}


@pytest.mark.parametrize(("text", "seconds"), [("1e3", 1000.0), ("1E+4", 10000.0), ("2.5e2", 250.0), ("600", 600.0)])
def test_exponent_numbers_are_numbers(tmp_path, text, seconds):
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("budget_seconds: 60", f"budget_seconds: {text}"), encoding="utf-8")
    assert load_config(cfg).budget_seconds == seconds


def test_absurd_budget_is_bounded_with_one_line(tmp_path):
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace("budget_seconds: 60", "budget_seconds: 1e300"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line \d+: budget_seconds must be a finite number of at most 1e\+09, got 1e\+300"):
        load_config(cfg)
    line = one_error_line(subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(1), capture_output=True, text=True,
                                         timeout=60))
    assert "budget_seconds" in line and "must be a number" not in line


def test_unparsable_action_template_is_a_config_error_not_internal(tmp_path):
    cfg = write_config(tmp_path, actions={"on_quarantine": ["/bin/echo", "{"]})
    with pytest.raises(ConfigError, match=r"sweep\.yaml: line \d+: invalid value: Single '\{' encountered"):
        load_config(cfg)
    line = one_error_line(subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(1), capture_output=True, text=True,
                                         timeout=60))
    assert "internal error" not in line


def test_lock_file_equal_to_history_path_exits_3_with_one_line(tmp_path):
    cfg = write_config(tmp_path, lock_file="state.db", history={"path": "state.db"})
    line = one_error_line(subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(1), capture_output=True, text=True,
                                         timeout=60))
    assert "lock_file" in line and "is the history database" in line
    assert not (tmp_path / "state.db").exists()

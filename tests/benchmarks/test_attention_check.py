"""benchmarks/attention_check.py on the CPU: the figures of one attention check per shape, a clean
check raising nothing, the JSON written whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aegis_cli.ops import attention_sums

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import attention_check


def test_one_check_per_shape_is_timed_and_clean(tmp_path, capsys):
    out = attention_check.main(["--device", "cpu", "--reps", "1", "--shape", "1,4,2,80,32", "2,2,2,33,64",
                                "--json", str(tmp_path / "a.json")])
    assert [r["shape"] for r in out["shapes"]] == ["1,4,2,80,32", "2,2,2,33,64"]
    for r in out["shapes"]:
        assert r["sides_ms"] > 0 and r["outputs_ms"] > 0 and r["check_ms"] > 0
        assert r["signals"] == [] and set(r["clean_max"]) == set(attention_sums.INVARIANTS)
        assert all(0 <= v < attention_sums.DEFAULT_TAU[n] for n, v in r["clean_max"].items())  # clean: under τ (units of σ)
    assert json.loads((tmp_path / "a.json").read_text())["shapes"] == out["shapes"]
    assert "one attention check" in capsys.readouterr().out

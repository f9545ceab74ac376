"""What the CLI draws: strings from reports are shown as written, never read as rich markup."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aegis_cli import cli
from tests.fleet_helpers import aegis, env

HOSTILE = ["[/bold]", "[green]all fine[/green]", "[link=https://example.invalid]x[/link]", "trailing\\"]


def _report(host: str, summary: str) -> dict:
    return {"schema_version": "1.1", "kind": "scan", "host": host,
            "devices": [{"device": {"id": "cuda:0", "uuid": "GPU-0", "name": "[red]H200[/red]", "host": host},
                         "verdict": "FAULTY", "error": "[/]",
                         "evidence": [{"severity": "FAULTY", "check": "gemm.row_checksum", "case_id": "w/[b]", "summary": summary}]}]}


@pytest.mark.parametrize("text", HOSTILE)
def test_report_strings_are_drawn_literally_in_the_fleet_table(tmp_path, text):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(_report(text, f"summary {text}")))
    out = subprocess.run(aegis("report", str(p)), env=env(1), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-400:]  # FAULTY, not an internal error (3)
    flat = "".join(out.stdout.split())  # the table may fold long cells
    assert "".join(text.split()) in flat and f"summary{''.join(text.split())}" in flat
    assert "w/[b]" in flat and "[/]" in flat  # the case id, and the error (cut to its first 80 characters)


def test_a_workload_named_like_markup_is_drawn_literally_in_the_scan_table(tmp_path, capsys):
    src = Path(__file__).resolve().parents[1] / "data" / "tiny.yaml"
    text = src.read_text()
    assert "name: tiny" in text
    wl = tmp_path / "w.yaml"
    wl.write_text(text.replace("name: tiny", 'name: "[bold]ok[red]"'))
    with pytest.raises(SystemExit) as exc:
        cli.main(["scan", "-q", "--device", "cpu", "--probes", "gemm", "--workload", str(wl), "--inject", "bitflip:target=acc,bit=exp",
                  "--reruns", "1"])
    assert exc.value.code == 2
    out = capsys.readouterr().out
    assert any(line.startswith("FAULTY cpu:0 [bold]ok[red]/") for line in out.splitlines()), out  # the evidence line


def test_info_names_the_catalog_folder_and_the_catalogs_apart(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["info"])
    assert exc.value.code in (0, None)
    rows = [line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3]
    assert rows.count("workloads") == 1 and "workloads path" in rows


def test_replaying_a_self_tests_capture_does_not_advise_watching_for_an_intermittent_fault(tmp_path):
    bundle, scan = tmp_path / "b.aegis", tmp_path / "s.json"
    case = "cpu-quick/qkv/fwd/normal/192x384x256/s+0+0"
    with pytest.raises(SystemExit):
        cli.main(["scan", "--device", "cpu", "--case", case, "--reruns", "1", "--probes", "gemm", "--inject", "bitflip:target=acc,bit=exp",
                  "--save-vtasks", str(bundle), "--format", "json", "-o", str(scan), "-q"])
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", str(bundle), "--device", "cpu", "--format", "json", "-o", str(out), "-q", "--repeat", "1"])
    assert exc.value.code == 0
    for o in json.loads(out.read_text())["devices"][0]["probes"]["replay"]["outcomes"]:
        assert o["outcome"] == "not_reproduced" and o["same_device"]
        assert "intermittent" not in o["meaning"] and "self-test" in o["meaning"] and "injected on purpose" in o["meaning"]


def test_a_large_fleet_table_shows_the_devices_that_matter_and_counts_the_rest():
    import io

    from rich.console import Console

    from aegis_cli import render

    devices = [{"device": {"id": f"cuda:{i % 8}", "uuid": f"GPU-{i}", "host": f"n{i // 8}"}, "verdict": "HEALTHY", "evidence": []}
               for i in range(5000)]
    devices[4321]["verdict"] = "FAULTY"
    console = Console(file=io.StringIO(), width=200)
    render.fleet_table(console, {"kind": "fleet", "devices": devices})
    out = console.file.getvalue()
    rows = [line for line in out.splitlines() if "GPU-" in line]
    assert len(rows) == render.FLEET_ROWS and "GPU-4321" in rows[0] and "FAULTY" in rows[0]
    assert f"… {5000 - render.FLEET_ROWS} more devices not shown (all: 1 FAULTY, 4999 HEALTHY" in out


def test_history_strings_are_drawn_literally(tmp_path, capsys):
    from aegis_cli.fleet.history import History
    from tests.fleet.test_history import doc

    d = doc({"GPU-[/bold]": "FAULTY"})
    d["devices"][0]["device"]["host"] = "[green]n1[/green]"
    d["devices"][0]["error"] = "[/]"
    db = tmp_path / "h.sqlite"
    with History(db) as h:
        h.record_sweep(d)
    with pytest.raises(SystemExit) as exc:
        cli.main(["history", "--db", str(db), "--device", "GPU-[/bold]"])
    assert exc.value.code in (0, None)
    flat = "".join(capsys.readouterr().out.split())
    assert "GPU-[/bold]" in flat and "[green]n1[/green]" in flat and "[/]" in flat

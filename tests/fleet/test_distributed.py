"""Cross-device comparison: 3 gloo ranks on one CPU machine with one faulty rank, the
comparison rules (odd one out vs INCONCLUSIVE), and `aegis report` merging node reports."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from aegis_cli.fleet.compare import CONSISTENT, INCONCLUSIVE, ODD_ONE_OUT, PROBE_KEY, apply, compare, fleet_exit
from aegis_cli.fleet.merge import merge
from aegis_cli.ops.errors import ConfigError
from tests.fleet_helpers import aegis, env, write_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_gloo_ranks_flag_exactly_the_faulty_rank(tmp_path):
    cfg = write_config(tmp_path, devices="auto", inject="bitflip:bit=exp,device=cpu:2", drill=True,
                       distributed={"fleet_report": "fleet.json", "timeout_seconds": 60})
    port, world = free_port(), 3
    t0 = time.time()
    procs = [subprocess.Popen(aegis("sweep", "--config", str(cfg)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(1, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    took = time.time() - t0
    assert [p.returncode for p in procs] == [2, 2, 2], [o[1][-800:] for o in outs]
    fleet = json.loads((tmp_path / "fleet.json").read_text())
    assert fleet["kind"] == "fleet" and fleet["outcome"] == ODD_ONE_OUT and fleet["distributed"] == {"world_size": 3, "backend": "gloo"}
    assert [o["device"].split("/")[1] for o in fleet["comparison"]["odd"]] == ["cpu:2"]
    verdicts = {d["device"]["id"]: d["verdict"] for d in fleet["devices"]}
    assert verdicts == {"cpu:0": "HEALTHY", "cpu:1": "HEALTHY", "cpu:2": "FAULTY"}
    odd = next(d for d in fleet["devices"] if d["device"]["id"] == "cpu:2")
    assert any(e["check"] == "fleet.cross_device_fingerprint" for e in odd["evidence"])
    # one derived seed for every rank (rank 0's): fingerprints of other inputs would never compare
    assert len({d["coverage"]["seed"] for d in fleet["devices"]}) == 1 and fleet["seed"] == fleet["devices"][0]["coverage"]["seed"]
    # every rank recorded its device; the node's exports list the faulty one
    from aegis_cli.fleet.history import History

    with History(tmp_path / "history.sqlite") as h:
        assert sorted(r.device_id for r in h.results()) == ["cpu:0", "cpu:1", "cpu:2"]
    q = [ln for ln in (tmp_path / "quarantine.tsv").read_text().splitlines() if not ln.startswith("#")]
    assert len(q) == 1 and "\tcpu:2\t" in q[0]
    print(f"3 gloo ranks: {took:.1f} s")


def dev(host: str, idx: int, fps: dict, verdict: str = "HEALTHY", cls: str = "c1", noise: float = 1e-9) -> dict:
    return {"device": {"id": f"cuda:{idx}", "uuid": f"{host}-{idx}", "host": host, "name": "H200"}, "verdict": verdict,
            "workload": "w", "error": None, "stats": None, "timings": {"seconds": 1.0},
            "evidence": [], "noise": {"clean_max": noise}, "probes": {PROBE_KEY: {"class": cls, "fingerprints": fps}}}


def test_compare_rules():
    a, b = {"x": "1", "y": "2"}, {"x": "1", "y": "9"}
    three = [dev("n1", 0, a), dev("n2", 0, a), dev("n3", 0, b)]
    c = compare(three)
    assert c["outcome"] == ODD_ONE_OUT and [o["device"] for o in c["odd"]] == ["n3/cuda:0"] and c["odd"][0]["cases"] == ["y"]
    assert [d["verdict"] for d in apply(three, c)] == ["HEALTHY", "HEALTHY", "FAULTY"]
    two = [dev("n1", 0, a), dev("n2", 0, b)]
    c = compare(two)
    assert c["outcome"] == INCONCLUSIVE and not c["odd"] and "software cause" in c["note"]
    assert fleet_exit(apply(two, c), c["outcome"]) == 3
    # different classes (model/software) are never compared with each other
    assert compare([dev("n1", 0, a, cls="h200"), dev("n2", 0, b, cls="a100")])["outcome"] == "NOT_COMPARED"
    same = [dev("n1", 0, a), dev("n2", 0, a), dev("n3", 0, a, noise=1e-6)]
    c = compare(same)
    assert c["outcome"] == CONSISTENT and [o["device"] for o in c["noise_outliers"]] == ["n3/cuda:0"]
    assert [d["verdict"] for d in apply(same, c)] == ["HEALTHY", "HEALTHY", "SUSPECT"]


def test_report_merges_node_reports(tmp_path):
    a = {"x": "1"}
    paths = []
    for host, fps in (("n1", a), ("n2", a), ("n3", {"x": "2"})):
        rep = {"schema_version": "1.0", "kind": "sweep", "host": host, "finished": "2026-01-01T00:00:00+00:00",
               "devices": [dev(host, 0, fps), dev(host, 1, fps)]}
        p = tmp_path / f"{host}.json"
        p.write_text(json.dumps(rep))
        paths.append(str(p))
    fleet = merge(paths)
    assert fleet["outcome"] == ODD_ONE_OUT and sorted(o["device"] for o in fleet["comparison"]["odd"]) == ["n3/cuda:0", "n3/cuda:1"]
    assert fleet["exit_code"] == 2 and fleet["hosts"] == ["n1", "n2", "n3"]
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    p = subprocess.run(aegis("report", *paths, str(bad)), env=env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and f"Error: {bad}: not a JSON report" in p.stderr
    p = subprocess.run(aegis("report", *paths, "--format", "csv"), env=env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout.count("\n") == 7 and "n3,cuda:1" in p.stdout


def test_compare_blames_only_the_odd_gpu_when_every_task_sees_cuda0():
    # srun --gpus-per-task=1: each of a node's tasks sweeps "cuda:0", a different physical GPU
    devs = [dev("n1", 0, {"x": "2" if r == 3 else "1"}) for r in range(4)]
    for r, d in enumerate(devs):
        d["device"]["uuid"] = f"GPU-{r}"
    c = compare(devs)
    assert c["outcome"] == ODD_ONE_OUT and [o["device"] for o in c["odd"]] == ["n1/cuda:0/GPU-3"]
    assert [d["verdict"] for d in apply(devs, c)] == ["HEALTHY", "HEALTHY", "HEALTHY", "FAULTY"]


def test_a_rank_that_stops_is_one_clear_error_on_the_others(tmp_path):
    # rank 1 is stopped by SIGTERM while its worker hangs: rank 0's all-gather breaks, which it
    # reported as "internal error: RuntimeError … (a bug in aegis …)"
    import signal

    cfg = write_config(tmp_path, devices="auto", inject="hang:seconds=120,device=cpu:1", distributed={"timeout_seconds": 60})
    port, world = free_port(), 2
    procs = [subprocess.Popen(aegis("sweep", "--config", str(cfg)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env(1, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(world)]
    try:
        for line in procs[1].stderr:  # its worker has started: the sweep's SIGTERM handler is in place
            if "event=device_start" in line:
                break
        procs[1].send_signal(signal.SIGTERM)
        _, err0 = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3 and procs[1].returncode == 3
    assert "another rank probably stopped" in err0 and "internal error" not in err0, err0[-800:]


def test_report_merges_reports_that_name_no_host(tmp_path):
    # "host": null passes the checks (a host is optional); it crashed the merge's sort by host
    paths = []
    for i, host in enumerate((None, "n2")):
        rep = {"schema_version": "1.0", "kind": "scan", "host": host,
               "devices": [{"device": {"id": "cuda:0", "uuid": f"GPU-{i}"}, "verdict": "HEALTHY"}]}
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(rep))
    fleet = merge([str(p) for p in paths])
    assert [d["device"]["host"] for d in fleet["devices"]] == ["?", "n2"] and fleet["exit_code"] == 0


@pytest.mark.parametrize("extra, message", [
    ({"seed": [1]}, "seed must be an integer"),
    ({"injected": [{"model": "bitflip"}]}, "injected must be a list of strings"),
    ({"injected": ["bitflip", 1]}, "injected must be a list of strings"),
])
def test_report_refuses_header_fields_of_the_wrong_type(tmp_path, extra, message):
    rep = {"schema_version": "1.0", "kind": "scan", "host": "n1", **extra,
           "devices": [{"device": {"id": "cuda:0", "uuid": "GPU-0"}, "verdict": "HEALTHY"}]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rep))
    with pytest.raises(ConfigError, match=rf"r\.json: {message}"):
        merge([str(p), str(p)])


def test_report_renders_minimal_device_entries_in_every_format(tmp_path):
    # name, workload, timings and an evidence's check/case_id are optional in a report: the
    # table, CSV and Prometheus output crashed on them (KeyError: 'name', 'check')
    rep = {"schema_version": "1.0", "kind": "scan", "host": "n1",
           "devices": [{"device": {"id": "cuda:0", "uuid": "GPU-0"}, "verdict": "FAULTY", "evidence": [{"severity": "FAULTY"}]}]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rep))
    for fmt, expect in (("table", "cuda:0"), ("csv", "n1,cuda:0,GPU-0,,FAULTY"), ("prom", 'uuid="GPU-0",name="",host="n1"')):
        out = subprocess.run(aegis("report", str(p), "--format", fmt), env=env(1), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and expect in out.stdout, (fmt, out.stderr[-400:])
    rep["devices"][0]["error"] = 5
    p.write_text(json.dumps(rep))
    with pytest.raises(ConfigError, match=r"devices\[0\]: error must be a string"):
        merge([str(p)])

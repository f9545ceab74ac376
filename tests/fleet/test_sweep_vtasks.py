"""A sweep pointed at a directory of captured vTasks (``vtasks: DIR``, issue 20 §6): every
device replays every bundle (a scan's, and the *.aegis bundles a training loop's sensors saved
there), the outcome per device is in the report and the history, and a corrupt or hostile
bundle is one error entry, never the end of the sweep."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from aegis_cli.fleet.history import History
from aegis_cli.scan import ScanOptions, run_scan
from aegis_cli.sensors import SensorConfig, instrument, uninstrument
from aegis_cli.vtask.from_scan import save_scan_vtasks
from tests.fleet_helpers import WORKLOAD, aegis, env, write_config
from tests.sensors.test_instrument import loss_and_grads
from tests.sensors.tiny import batches, gpt


@pytest.fixture(scope="module")
def vtask_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vt")
    drop = tmp / "vtasks"
    drop.mkdir()
    (tmp / "wl.yaml").write_text(WORKLOAD, encoding="utf-8")
    # a self-test scan's capture (aegis scan --inject … --save-vtasks): a permanent exponent flip, saved as a bundle
    rep = run_scan(ScanOptions(devices="cpu:0", workload=str(tmp / "wl.yaml"), probes=("gemm",), reruns=1,
                               inject="bitflip:bit=exp,device=cpu:0", keep_flagged=True))
    assert rep.devices[0].verdict.value == "FAULTY" and save_scan_vtasks(rep, drop / "captured.safetensors") > 0
    training = _training_bundles(drop)  # what the sensors' bundle_dir holds: *.aegis
    (drop / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + os.urandom(64))
    os.symlink("/etc/passwd", drop / "link.safetensors")
    (drop / "notes.txt").write_text("not a bundle: left alone")
    cfg = write_config(tmp, vtasks="vtasks", fingerprint_cases=0)
    p = subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(2), capture_output=True, text=True, timeout=180)
    return tmp, p, training


def _training_bundles(drop) -> list[str]:
    """Bundles a training loop's sensors saved into ``drop`` (their bundle_dir): a GEMM accumulator
    fault and an attention fault, each confirmed in one step of the tiny GPT."""
    names = []
    for spec in ("bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant,device=cpu:0", "perturb:target=attn.dv,r=1000,op=sdpa#1"):
        model = gpt()
        h = instrument(model, SensorConfig(overhead_budget=None, attention=True, inject=spec, bundle_dir=str(drop)))
        loss_and_grads(model, *next(batches()))
        h.step()
        uninstrument(model)
        names += [os.path.basename(e.bundle) for e in h.events if e.kind == "confirmed"]
    assert len(names) == 2 and all(n.endswith(".aegis") for n in names)
    return names


def test_sweep_replays_each_bundle_on_each_device(vtask_sweep):
    tmp, p, training = vtask_sweep
    assert p.returncode == 0, p.stderr  # the sweep itself runs no injection: both devices HEALTHY
    doc = json.loads((tmp / "report.json").read_text())
    sha = hashlib.sha256((tmp / "vtasks" / "captured.safetensors").read_bytes()).hexdigest()
    for d in doc["devices"]:
        assert d["verdict"] == "HEALTHY"
        got = {e["bundle"]: e for e in d["probes"]["vtasks"]["bundles"]}
        assert set(got) == {"captured.safetensors", "corrupt.safetensors", "link.safetensors", *training}  # notes.txt is no bundle
        ok = got["captured.safetensors"]
        # captured with its fault injected on purpose: without it, it does not reproduce anywhere
        assert ok["outcome"] == "not_reproduced" and ok["sha256"] == sha and ok["vtasks"] > 0 and ok["verdict"] == "HEALTHY"
        assert got["corrupt.safetensors"]["outcome"] == "error" and "corrupt.safetensors" in got["corrupt.safetensors"]["error"]
        assert got["link.safetensors"]["outcome"] == "error" and "symbolic link" in got["link.safetensors"]["error"]
        assert got["link.safetensors"]["sha256"] is None  # never opened through the link
        for name in training:  # the sensors' captures (GEMM, attention), injected then: clean here
            assert got[name]["outcome"] == "not_reproduced" and got[name]["vtasks"] >= 1 and got[name]["verdict"] == "HEALTHY"
    (summary,) = [b for b in doc["sweep"]["vtasks"]["bundles"] if b["bundle"] == "captured.safetensors"]
    assert summary["not_reproduced"] == ["cpu:0", "cpu:1"] and summary["points_at"] == "nothing: not reproduced"
    assert "event=vtask_replayed" in p.stderr and "outcome=error" in p.stderr


def test_replays_are_recorded_per_device_in_history(vtask_sweep):
    tmp, _, training = vtask_sweep
    with History(tmp / "history.sqlite") as h:
        rows = h.results()
    assert sorted(r.device_id for r in rows) == ["cpu:0", "cpu:1"]
    for r in rows:
        outcomes = {e["bundle"]: e["outcome"] for e in r.vtasks}
        assert outcomes == {"captured.safetensors": "not_reproduced", "corrupt.safetensors": "error", "link.safetensors": "error",
                            **dict.fromkeys(training, "not_reproduced")}
        assert all(len(e["sha256"] or "") in (0, 64) for e in r.vtasks)


def test_replays_that_outlast_the_timeout_keep_the_scan_verdict(vtask_sweep, tmp_path):
    """A directory whose replays take longer than the device's timeout: the worker is killed while
    replaying, the finished scan's verdict stands and the replays are one recorded error."""
    src, _, _ = vtask_sweep
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "captured.safetensors").write_bytes((src / "vtasks" / "captured.safetensors").read_bytes())
    cfg = write_config(tmp_path, vtasks="drop", fingerprint_cases=0, device_timeout_seconds=10, drill=True,
                       inject="hang:seconds=300,when=replay")  # a replay that never ends
    p = subprocess.run(aegis("sweep", "--config", str(cfg)), env=env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (d,) = json.loads((tmp_path / "report.json").read_text())["devices"]
    assert d["verdict"] == "HEALTHY" and "replays not finished: worker timed out" in d["probes"]["vtasks"]["error"]
    assert "event=vtasks_not_replayed level=error" in p.stderr or "level=error event=vtasks_not_replayed" in p.stderr
    with History(tmp_path / "history.sqlite") as h:
        (r,) = h.results()
    assert r.verdict == "HEALTHY" and r.vtasks[0]["outcome"] == "error" and "timed out" in r.vtasks[0]["error"]


def test_replay_hang_hook_is_checked():
    from aegis_cli.faults.spec import InjectSpecError, parse_spec

    assert parse_spec("hang:seconds=1,when=replay", worker=True)[0].params["when"] == "replay"
    with pytest.raises(InjectSpecError, match="when must be scan or replay"):
        parse_spec("hang:seconds=1,when=later", worker=True)


@pytest.mark.parametrize("golden", ["bundle-v2.aegis", None])
def test_each_bundle_is_read_once(golden, tmp_path, monkeypatch):
    """It was read twice, for its hash and to replay it: a bundle replaced in between was
    replayed under the other file's hash. An entry that fails to parse keeps the hash."""
    import builtins
    from pathlib import Path

    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.fleet.vtasks import replay_one

    path = tmp_path / "b.safetensors"
    data = (Path(__file__).parents[1] / "golden" / golden).read_bytes() if golden else b"\x10" + bytes(40)
    path.write_bytes(data)
    opened, real_open = [], builtins.open

    def counted_open(f, *a, **k):
        opened.append(str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr(builtins, "open", counted_open)
    entry = replay_one(CpuDevice(), path)
    assert opened.count(str(path)) == 1 and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["outcome"] == ("not_reproduced" if golden else "error") and (entry.get("vtasks", 0) > 0) == bool(golden)

"""GPU tier of the burn-in: the asynchronous launcher gives the bits of the scan's checked GEMM,
the device screen agrees with the full checks, and a short --soak on the GPU is HEALTHY with
telemetry and catches an intermittent injected fault as "k of n launches"."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends import resolve_devices
from aegis_cli.backends.fingerprints import device_fingerprint_tensor
from aegis_cli.backends.soak_cuda import Launcher
from aegis_cli.checks import gemm as gemm_checks
from aegis_cli.checks import screen
from aegis_cli.ops import fingerprint, numerics
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.soak.run import SoakOptions, run_soak

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("mnk", [(256, 384, 512), (200, 136, 72)], ids=str)
def test_launcher_gives_the_checked_gemms_bits(layout, mnk):
    (dev,) = resolve_devices("cuda:0")
    m, n, k = mnk
    a = dev.generate(layout.a_stored_shape(m, k), "normal", 1)
    b = dev.generate(layout.b_stored_shape(k, n), "heavy", 2)
    ops = GemmOperands(a, b, layout)
    want = dev.checked_gemm(ops)
    launcher = Launcher(dev)
    p = launcher.prepare(ops)
    runs = [launcher.run(p) for _ in range(3)]
    slab = launcher.slab(p, 3)  # the burn-in's path: every launch into a slot of one slab
    runs += [slab.result(i, launcher.run_into(p, slab, i), False) for i in range(3)]
    torch.cuda.synchronize()
    assert len({r.c.data_ptr() for r in runs}) == 6  # each launch keeps its own outputs
    for r in runs:
        for name in ("c", "row_sums", "col_sums"):
            assert torch.equal(getattr(r, name).view(torch.int8 if name == "c" else torch.int32).cpu(),
                               getattr(want, name).view(torch.int8 if name == "c" else torch.int32).cpu()), name
        assert bool((r.tile_sm >= 0).all())  # every checksum tile ran (which SM ran it varies)
        fp = int(device_fingerprint_tensor(r.c).view(torch.uint64).item())
        assert fp == fingerprint.fingerprint(want.c.cpu())
    ref = dev.reference_checksums(ops, dev.tile)
    tau = numerics.Thresholds().tau
    counts = screen.flagged([r.row_sums for r in runs], [r.col_sums for r in runs], screen.limits(ref, tau)).tolist()
    assert counts == [0] * 6
    assert screen.flagged(slab.row_sums, slab.col_sums, screen.limits(ref, tau)).tolist() == [0] * 3
    assert not gemm_checks.check_gemm(runs[0], ref, tau).signals


def test_soak_on_the_gpu_is_healthy_with_telemetry():
    rep = run_soak(SoakOptions(seconds=6, devices="cuda:0"))
    d = rep.to_dict()["devices"][0]
    s = d["soak"]
    assert d["verdict"] == "HEALTHY", d["error"]
    assert s["launches"] > 100 and s["failures"]["launches"] == 0 and s["tflops"] > 0
    assert s["telemetry"]["available"] and s["telemetry"]["sm_clock_mhz"]["peak"] > 0


def test_soak_on_the_gpu_catches_an_intermittent_fault():
    rep = run_soak(SoakOptions(seconds=6, devices="cuda:0", inject="bitflip:target=acc,bit=exp,prob=0.01"))
    d = rep.to_dict()["devices"][0]
    f = d["soak"]["failures"]
    assert d["verdict"] == "FAULTY", (d["error"], f)
    assert 0 < f["launches"] < f["of"]
    assert any(e["severity"] == "FAULTY" and f"{f['launches']} of {f['of']}" in e["summary"] for e in d["evidence"])

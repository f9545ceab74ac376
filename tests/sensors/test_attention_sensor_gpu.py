"""The attention sensor on CUDA (tier 2, ``gpu``): SensorConfig(attention=True) routes the small
GPT's SDPA calls through aegis' checked attention kernels; the model trains like its plain self
within bf16 tolerance, repeats bit for bit, raises nothing when clean, and an injected attention
fault is caught, confirmed, saved and replayed by ``aegis replay`` (reproduced with the injection,
not without)."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from aegis_cli.vtask.bundle import read_bundle
from tests.helpers import run_cli
from tests.sensors.test_sensors_gpu import CFG, CUDA, cuda_gpt, deterministic, flat, loss_and_grads, on_cuda, rel
from tests.sensors.tiny import batches

gpu = pytest.mark.gpu
ATTN = {"overhead_budget": None, "attention": True}


@gpu
def test_checked_attention_on_cuda_matches_the_plain_model_and_repeats_bit_for_bit():
    x, y = on_cuda(next(batches(CFG, 8)))
    model = cuda_gpt()
    loss0, g0 = loss_and_grads(model, x, y)  # torch's SDPA and GEMMs, bf16
    runs = []
    for _ in range(2):
        h = instrument(model, SensorConfig(**ATTN))
        runs.append(loss_and_grads(model, x, y))
        assert h.step() is Action.CONTINUE
        uninstrument(model)
        s = h.stats_dict()
        assert s["attention_launches"] == CFG.layers and s["attention_unchecked"] == {}, s
        assert s["checked"] == 3 * (4 * CFG.layers + 1) + CFG.layers and s["raised"] == 0, s
        assert h.device_for(x).identity.backend == "cuda"
    (loss1, g1), (loss2, g2) = runs
    assert abs(loss1 - loss0) <= 1e-2 * abs(loss0)
    assert rel(flat(g1), flat(g0)) < 5e-2
    assert loss1 == loss2 and all(torch.equal(g1[n].view(torch.int16), g2[n].view(torch.int16)) for n in g1)


@gpu
def test_attention_checks_wait_for_no_device_sync_and_are_charged_at_the_boundary(monkeypatch):
    """An attention check is timed by CUDA events, as a GEMM check is: no device synchronisation of
    its own (it drained the GPU before each check), its cost read at the step boundary."""
    from aegis_cli.backends.cuda import CudaDevice

    x, y = on_cuda(next(batches(CFG, 8)))
    model = cuda_gpt()
    h = instrument(model, SensorConfig(**ATTN))
    syncs = []
    with monkeypatch.context() as m:
        m.setattr(CudaDevice, "synchronize", lambda self: syncs.append(self.index))
        loss_and_grads(model, x, y)
    ops = {key: st for key, st in h.controller.ops.items() if key.startswith("sdpa/")}
    assert syncs == [] and len(h.timed) == CFG.layers and ops and all(st.cost_s is None for st in ops.values())
    h.step()
    assert h.timed == [] and all(st.cost_s > 0 for st in ops.values()) and h.stats.checked == 3 * (4 * CFG.layers + 1) + CFG.layers
    uninstrument(model)


@gpu
@pytest.mark.parametrize("spec, check", [("perturb:target=attn.dv,r=1000,op=sdpa#1", "attention.dv_colsum"),
                                         ("perturb:target=attn.pv,r=100,op=sdpa#0", "attention.o_rowsum")])
def test_injected_attention_fault_is_caught_confirmed_saved_and_replayed_on_cuda(spec, check, tmp_path, capsys):
    x, y = on_cuda(next(batches(CFG, 8)))
    model = cuda_gpt()
    h = instrument(model, SensorConfig(**ATTN, inject=spec, bundle_dir=str(tmp_path)))
    loss_and_grads(model, x, y)
    assert h.step() is Action.STOP
    uninstrument(model)
    confirmed = [e for e in h.events if e.kind == "confirmed"]
    assert len(confirmed) == 1 and h.stats.confirmed == 1 and h.stats.saved == 1, [e.summary for e in h.events]
    ev = confirmed[0]
    assert ev.check == check and ev.severity == "FAULTY" and ev.op == spec.split("op=")[1]
    assert ev.evidence[0].reproduced == 2 and ev.evidence[0].injected and h.stats_dict()["never_fired"] == []
    vt = read_bundle(ev.bundle).vtasks[0]
    assert vt.kind == "attention" and vt.case_id == ev.site and vt.provenance["gpu_uuid"] == h.device_for(x).identity.uuid
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", CUDA, "--inject", spec, "--format", "json", "-q")
    assert code == 2 and '"outcome": "reproduced"' in out and '"matches_capture": true' in out
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", CUDA, "--format", "json", "-q")
    assert code == 0 and '"outcome": "not_reproduced"' in out


@gpu
def test_calls_are_drawn_at_their_forward_and_unsampled_ones_run_torchs_sdpa(monkeypatch):
    """The fast path: nothing sampled runs the plain model's SDPA and Linears, bit for bit, and no
    checked-attention kernel; under the coverage floor alone (every operator once in 2 steps) one
    call of the two steps' runs the checked kernels and is compared, the others torch's."""
    from aegis_cli.backends.cuda import CudaDevice

    forwards = []
    original = CudaDevice.attention_forward
    monkeypatch.setattr(CudaDevice, "attention_forward", lambda self, *a, **kw: forwards.append(1) or original(self, *a, **kw))
    x, y = on_cuda(next(batches(CFG, 8)))
    model = cuda_gpt()
    with deterministic():  # SDPA's math backend: its backward repeats bit for bit
        loss0, g0 = loss_and_grads(model, x, y)
        h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None, attention=True))
        loss1, g1 = loss_and_grads(model, x, y)
        h.step()
        uninstrument(model)
        assert forwards == [] and loss1 == loss0 and all(torch.equal(g1[n], g0[n]) for n in g0)
        assert h.stats.attention_launches == CFG.layers and h.stats.checked == 0
        h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=2, attention=True))
        for _ in range(2):
            loss_and_grads(model, x, y)
            h.step()
        uninstrument(model)
    op = next(o for k, o in h.stats_dict()["operators"].items() if k.startswith("sdpa/"))
    assert len(forwards) == op["checked"] == 1 and op["launches"] == 2 * CFG.layers and h.stats.raised == 0

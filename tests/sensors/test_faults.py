"""Injected faults in training: a GEMM accumulator fault is caught, confirmed, saved as a vTask of
the real operands, and `aegis replay` reproduces it with the same injection and not without; a bit
flip in a checkpointed activation is caught and confirmed by the recompute sensor."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.ops.verdict import Verdict
from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from aegis_cli.sensors.checkpoint import OUTPUT, SAVED_INPUT, RegionContext, prints, verify_region
from aegis_cli.sensors.snapshot import rng_state
from aegis_cli.vtask.bundle import read_bundle
from tests.helpers import run_cli
from tests.sensors.tiny import inputs, mlp

ACC_FAULT = "bitflip:op=fc2/fwd,bit=hi-mant,device=cpu:0"


def one_step(model, cfg: SensorConfig):
    h = instrument(model, cfg)
    x = inputs()
    model(x).square().mean().backward()
    action = h.step()
    uninstrument(model)
    return h, action


def test_accumulator_fault_is_caught_confirmed_saved_and_replayed(tmp_path, capsys):
    model = mlp()
    w = model.fc2.weight.detach().to(torch.bfloat16)
    h, action = one_step(model, SensorConfig(overhead_budget=None, inject=ACC_FAULT, bundle_dir=str(tmp_path), job="t", rank=3))
    assert action is Action.STOP  # the default policy: stop on confirmed corruption
    confirmed = [e for e in h.events if e.kind == "confirmed"]
    assert len(confirmed) == 1 and h.stats.raised == 1 and h.stats.saved == 1
    ev = confirmed[0]
    assert ev.op == "fc2" and ev.check == "gemm.row_checksum" and ev.severity == "FAULTY" and ev.step == 0
    assert ev.latency_s is not None and ev.latency_steps == 0 and ev.bundle is not None
    assert ev.evidence[0].injected and ev.evidence[0].recompute["beyond_bound"] > 0
    assert h.last_clean_step is None  # step 0 itself is not clean

    bundle = read_bundle(ev.bundle)
    vt = bundle.vtasks[0]
    assert vt.op == "fc2" and vt.case_id == "train/fc2/fwd/64x32x64" and vt.gemm.subset == "full"
    assert vt.provenance["step"] == 0 and vt.provenance["rank"] == 3 and vt.provenance["job"] == "t"
    assert vt.provenance["injected"] is True and vt.provenance["gpu_uuid"] == CpuDevice(0).identity.uuid
    assert vt.provenance["kernel_hashes"] and vt.provenance["versions"]["torch"] == torch.__version__  # as a scan's vTasks
    assert torch.equal(vt.tensors["b"], w)  # the real weight the layer used, not a draw
    assert vt.observed["severity"] == "FAULTY" and vt.observed["source"] == "training"

    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", "cpu:0", "--inject", ACC_FAULT, "--format", "json")
    assert code == 2 and '"outcome": "reproduced"' in out
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", "cpu:0", "--format", "json")
    assert code == 0 and '"outcome": "not_reproduced"' in out


def test_without_bundle_dir_a_confirmed_gemm_is_reported_unsaved():
    h, _ = one_step(mlp(), SensorConfig(overhead_budget=None, inject="bitflip:op=head/wgrad,bit=exp"))
    ev = [e for e in h.events if e.kind == "confirmed"]
    assert len(ev) == 1 and ev[0].site.startswith("train/head/wgrad/") and "no bundle_dir" in ev[0].summary
    assert h.stats.unsaved == 1 and h.stats.saved == 0


def test_flip_in_a_checkpointed_activation_is_caught_and_confirmed(tmp_path):
    model = mlp(checkpointed=True)
    clean = mlp(checkpointed=True)
    x = inputs()
    clean(x).square().mean().backward()
    h, action = one_step(model, SensorConfig(overhead_budget=None, inject="memflip:op=ckpt/model,bit=hi-mant",
                                             bundle_dir=str(tmp_path)))
    assert action is Action.STOP and h.stats.fingerprinted == 1
    ev = [e for e in h.events if e.kind == "confirmed"]
    assert len(ev) == 1 and ev[0].check == SAVED_INPUT and ev[0].site == "ckpt/model" and ev[0].bundle is None
    assert "not saved" in ev[0].summary and h.stats.unsaved == 1 and not list(tmp_path.iterdir())
    # the recompute read the flipped activation, so the gradients below it differ from a clean run's
    assert not torch.equal(model.fc1.weight.grad, clean.fc1.weight.grad)
    assert h.stats.raised == 1  # the GEMM checks of the recompute stay clean: the flip is in its input, not its arithmetic


def _region(fn, x):
    out = fn(x)
    return RegionContext(fn, (x,), {}, rng_state([]), prints(((x,), {})), prints(((x,), {})), prints(out), prints(out),
                         [out])


def test_verify_region_says_which_run_was_wrong():
    x = inputs()
    fn = lambda t: torch.tanh(t) * 2  # deterministic
    good = _region(fn, x)
    bad = fn(x).clone()
    bad.view(torch.int32).view(-1)[5] ^= 1 << 20
    # the recompute's output was corrupted: re-runs agree with the forward
    rec = RegionContext(fn, (x,), {}, good.rng, good.in_fwd, good.in_rec, good.out_fwd, prints(bad), [bad])
    out = verify_region(rec, "r", "ckpt/r")
    assert out.severity is Verdict.FAULTY and "the recompute of r" in out.evidence.summary
    assert out.evidence.elements == 1 and out.evidence.samples[1]["index"] == 5
    # the forward's output was corrupted: re-runs agree with the recompute
    fwd = RegionContext(fn, (x,), {}, good.rng, good.in_fwd, good.in_rec, prints(bad), good.out_rec, [fn(x)])
    assert "the forward of r" in verify_region(fwd, "r", "ckpt/r").evidence.summary
    # re-runs that disagree: the region is not deterministic, nothing is confirmed
    calls = []
    noisy = lambda t: t + len(calls.append(0) or calls)
    odd = _region(noisy, x)
    odd.out_rec = prints(bad)
    res = verify_region(odd, "n", "ckpt/n")
    assert res.severity is Verdict.SUSPECT and res.nondeterministic and res.evidence.check == OUTPUT


def test_an_earlier_bundle_of_the_same_name_is_kept(tmp_path):
    cfg = SensorConfig(overhead_budget=None, inject=ACC_FAULT, bundle_dir=str(tmp_path))
    first, _ = one_step(mlp(), cfg)
    second, _ = one_step(mlp(), cfg)
    a, b = (next(e.bundle for e in h.events if e.kind == "confirmed") for h in (first, second))
    assert a != b and sorted(p.name for p in tmp_path.iterdir()) == sorted({a.rsplit("/", 1)[1], b.rsplit("/", 1)[1]})
    assert read_bundle(a).vtasks[0].id == read_bundle(b).vtasks[0].id  # the same launch, saved twice


def test_a_fault_that_never_fires_is_named(caplog):
    h, action = one_step(mlp(), SensorConfig(overhead_budget=None, inject="bitflip:op=no.such.layer"))
    assert action is Action.CONTINUE and h.stats_dict()["never_fired"] == ["bitflip:op=no.such.layer"]
    assert "never fired: bitflip:op=no.such.layer" in caplog.text


def test_regions_with_dropout_are_compared_under_the_forwards_random_state():
    from dataclasses import replace

    from tests.sensors.tiny import MICRO, batches, gpt

    model = gpt(cfg=replace(MICRO, dropout=0.2), checkpointing=True)
    h = instrument(model, SensorConfig(overhead_budget=None))
    for x, y in (next(batches()) for _ in range(2)):
        model(x, y)[1].backward()
        h.step()
    uninstrument(model)
    assert h.stats.fingerprinted == 4 and h.stats.raised == 0  # checkpointing replays the dropout masks
    # the verifier re-runs a region with the forward's random state, so its dropout agrees too
    x = inputs()
    fn = lambda t: torch.nn.functional.dropout(t, 0.5, training=True)
    rng = rng_state([])
    out = fn(x)
    bad = out.clone()
    bad.view(torch.int32).view(-1)[0] ^= 1
    ctx = RegionContext(fn, (x,), {}, rng, prints(((x,), {})), prints(((x,), {})), prints(out), prints(bad), [bad])
    assert verify_region(ctx, "d", "ckpt/d").severity is Verdict.FAULTY


@pytest.mark.parametrize("reentrant", [False, True])
def test_both_checkpoint_modes_are_fingerprinted(reentrant):
    from aegis_cli.sensors import checkpoint

    for inject, confirmed in ((None, 0), ("memflip:op=ckpt/model,bit=hi-mant", 1)):
        model = mlp()
        h = instrument(model, SensorConfig(overhead_budget=None, inject=inject))
        x = inputs().requires_grad_()
        model.head(checkpoint(model.body, x, use_reentrant=reentrant)).square().mean().backward()
        h.step()
        uninstrument(model)
        assert h.stats.fingerprinted == 1 and h.stats.confirmed == confirmed and x.grad is not None


def test_a_region_under_autocast_is_verified_under_the_forwards_autocast():
    """A recompute corrupted under bf16 autocast: the verifier's re-runs must compute what the forward
    computed (autocast on), or they agree with neither run and the fault is cleared."""
    from aegis_cli.sensors import checkpoint

    model = mlp()
    calls = []

    def body(x):
        y = model.body(x)
        calls.append(0)
        delta = torch.zeros_like(y)
        if len(calls) == 2:  # the recompute, in backward: one element off
            delta.view(-1)[3] = 1.0
        return y + delta

    h = instrument(model, SensorConfig(overhead_budget=None))
    x = inputs().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.head(checkpoint(body, x))
    out.float().square().mean().backward()
    h.step()
    uninstrument(model)
    ev = [e for e in h.events if e.kind in ("confirmed", "cleared")]
    assert len(ev) == 1 and ev[0].kind == "confirmed" and ev[0].check == OUTPUT, [e.summary for e in ev]
    assert "the recompute of" in ev[0].summary


def test_a_verification_that_fails_is_an_event_not_an_exception_in_the_loop():
    from aegis_cli.sensors import checkpoint

    model = mlp()
    calls = []

    def body(x):
        calls.append(0)
        if len(calls) > 2:  # the verifier's re-runs
            raise RuntimeError("region state gone")
        y = model.body(x)
        return y + (1.0 if len(calls) == 2 else 0.0)  # the recompute differs: a suspicion

    h = instrument(model, SensorConfig(overhead_budget=None))
    model.head(checkpoint(body, inputs().requires_grad_())).square().mean().backward()
    assert h.step() is Action.CONTINUE  # nothing confirmed: the loop goes on
    uninstrument(model)
    ev = [e for e in h.events if e.kind == "unverified"]
    assert len(ev) == 1 and "RuntimeError: region state gone" in ev[0].summary and ev[0].step == 0
    assert h.stats.unverified == 1 and h.stats.confirmed == h.stats.cleared == 0 and len(h.queue) == 0
    assert h.last_clean_step is None  # step 0 is not known clean

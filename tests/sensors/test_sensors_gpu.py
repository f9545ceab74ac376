"""The in-training sensors on a CUDA GPU (tier 2, ``gpu``): a small GPT from examples/train_gpt in
bf16 with every nn.Linear on aegis' checked GEMM kernels. Loss and gradients match the plain model
within bf16 tolerance, runs repeat bit for bit, 200 clean steps confirm nothing, an injected
accumulator fault (the kernels' AEGIS_INJECT build) is caught, confirmed, saved and replayed by
``aegis replay`` (reproduced with the injection, not without), a flip in a checkpointed activation
is caught, and the training-state guard recovers bit-exactly. The sensor's reference (sense.py)
is checked against the full fp64 reference here on CUDA, and on the CPU in test_reference.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from aegis_cli.ops import lean, numerics
from aegis_cli.ops.gemm import GemmOperands, Layout
from aegis_cli.ops.verdict import Verdict
from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from aegis_cli.sensors.checkpoint import SAVED_INPUT
from aegis_cli.sensors.guards import TrainingGuard
from aegis_cli.sensors.sense import launch
from tests.helpers import run_cli
from tests.sensors.tiny import GPTConfig, batches, gpt, grads

gpu = pytest.mark.gpu
CUDA = "cuda:0"
CFG = GPTConfig(vocab=512, seq=128, layers=2, heads=4, dim=128)  # K up to 512: a few k-blocks per tile
EVERY = {"overhead_budget": None}  # every launch compared with fp64
FAULT = "bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant"
LAYOUTS = list(Layout)
SHAPES = [(256, 384, 128), (300, 200, 136), (77, 1000, 264), (200, 300, 517)]  # ragged, odd K (no TMA)


@contextlib.contextmanager
def deterministic():
    """SDPA's math backend (its flash backward accumulates dq in a run-dependent order on an H200,
    benchmarks/RESULTS.md) and torch's deterministic algorithms, restored after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from aegis_cli.probes.computations import deterministic_algorithms

    with sdpa_kernel(SDPBackend.MATH), deterministic_algorithms():
        yield


def cuda_gpt(seed: int = 0, dtype=torch.bfloat16, cfg: GPTConfig = CFG, checkpointing: bool = False):
    return gpt(seed, cfg, checkpointing).to(CUDA, dtype)


def on_cuda(batch):
    return tuple(t.to(CUDA) for t in batch)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g[k].double().flatten() for k in sorted(g)])


# ------------------------------------------------------------------ the sensor's reference
def _ops(device: str, layout: Layout, m: int, n: int, k: int, seed: int) -> GemmOperands:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(layout.a_stored_shape(m, k), generator=g).to(torch.bfloat16)
    b = torch.randn(layout.b_stored_shape(k, n), generator=g).to(torch.bfloat16)
    return GemmOperands(a.to(device), b.to(device), layout)


@gpu
def test_lean_reference_on_cuda_is_within_a_twentieth_of_sigma():
    """The sensors' reference on CUDA (one read of each operand, fp64 slices of the large one) against
    the full fp64 reference: checksums within 0.05 σ, σ within 3%; s (with ρ: the stage bound) within
    3% of ``lean.stage_bound`` of the same operands, and never below the full reference's s."""
    from aegis_cli.backends.cuda import CudaDevice

    dev = CudaDevice(0)
    for layout in LAYOUTS:
        for i, (m, n, k) in enumerate([*SHAPES, (256, 512, 8192)]):
            ops = _ops(CUDA, layout, m, n, k, i)
            noise = dev.noise_model(k)
            full = numerics.reference_checksums(ops, dev.tile, noise)
            got_ref = lean.lean_reference(ops, dev.tile, noise)
            for got, want, sigma in ((got_ref.row, full.row, full.row_noise), (got_ref.col, full.col, full.col_noise)):
                assert float(((got - want).abs() / sigma).max()) <= 0.05, (layout, m, n, k)
            bounds = (lean.stage_bound(ops.a_mk, ops.b_kn, dev.tile[1]),
                      lean.stage_bound(ops.b_kn.t(), ops.a_mk.t(), dev.tile[0]).t())
            for got, want in ((got_ref.row_scale, bounds[0]), (got_ref.col_scale, bounds[1]),
                              (got_ref.row_noise, full.row_noise), (got_ref.col_noise, full.col_noise)):
                assert float(((got - want).abs() / want).max()) <= 0.03, (layout, m, n, k)
            assert (got_ref.row_scale >= full.row_scale * (1 - 1e-6)).all() and (got_ref.col_scale >= full.col_scale * (1 - 1e-6)).all()


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.value for x in LAYOUTS])
def test_enqueued_launch_gives_the_bits_of_checked_gemm(layout):
    """The sensors' unsynchronised launch (sense.launch) returns what Device.checked_gemm returns."""
    from aegis_cli.backends.cuda import CudaDevice

    dev = CudaDevice(0)
    for i, (m, n, k) in enumerate(SHAPES):
        ops = _ops(CUDA, layout, m, n, k, 10 + i)
        fast = launch(dev, ops, None, "train/x")
        ref = dev.checked_gemm(ops)
        torch.cuda.synchronize()
        assert fast.tile == ref.tile and fast.kernel == ref.kernel
        for got, want in ((fast.c, ref.c), (fast.row_sums, ref.row_sums), (fast.col_sums, ref.col_sums)):
            assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32)), (m, n, k)
        assert torch.equal(fast.tile_sm.cpu() >= 0, ref.tile_sm >= 0)  # every tile ran (SMs may differ)


# ------------------------------------------------------------------ training on CUDA
def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return float(loss.detach()), grads(model)


@gpu
@pytest.mark.parametrize("prob", [1.0, 0.5])  # 0.5: layers with an unsampled forward and a sampled backward (bias inside)
def test_instrumented_gpt_matches_the_plain_one_within_bf16_tolerance(prob):
    x, y = on_cuda(next(batches(CFG, 8)))
    with deterministic():
        loss32, g32 = loss_and_grads(cuda_gpt(dtype=torch.float32), x, y)  # fp32 cuBLAS: the yardstick
        model = cuda_gpt()
        loss_bf, g_bf = loss_and_grads(model, x, y)  # the plain bf16 model (cuBLAS)
        h = instrument(model, SensorConfig(**EVERY, sample_prob=prob, seed=3))
        loss1, g1 = loss_and_grads(model, x, y)
        assert h.step() is Action.CONTINUE
        uninstrument(model)
    s = h.stats_dict()
    linears = 4 * CFG.layers + 1
    assert s["launches"] == 3 * linears and s["raised"] == s["confirmed"] == 0, s
    assert s["checked"] == s["launches"] if prob == 1.0 else 0 < s["checked"] < s["launches"]
    assert h.device_for(x).identity.backend == "cuda"
    assert abs(loss1 - loss_bf) <= 1e-2 * abs(loss_bf)
    assert abs(loss1 - loss32) <= 3 * abs(loss_bf - loss32) + 5e-3
    assert rel(flat(g1), flat(g_bf)) < 5e-2
    assert rel(flat(g1), flat(g32)) <= 3 * rel(flat(g_bf), flat(g32)) + 1e-3
    for name, g in g_bf.items():
        assert g1[name].dtype == torch.bfloat16 and rel(g1[name], g) < 0.15, name


def train(steps: int, cfg: dict | None = None, *, checkpointing: bool = False, batch: int = 8, lr: float = 1e-3):
    model = cuda_gpt(checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    h = instrument(model, SensorConfig(**(cfg if cfg is not None else EVERY)))
    data, losses = batches(CFG, batch), []
    for _ in range(steps):
        x, y = on_cuda(next(data))
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        action = h.step()
        if action is Action.STOP:
            break
        opt.step()
        losses.append(loss.detach())
    uninstrument(model)
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}, h


@gpu
def test_repeated_runs_are_bit_identical_on_cuda():
    with deterministic():
        la, pa, ha = train(4)
        lb, pb, _ = train(4)
    assert torch.equal(la.view(torch.int32), lb.view(torch.int32))
    assert all(torch.equal(pa[n].view(torch.int16), pb[n].view(torch.int16)) for n in pa)
    assert ha.stats.confirmed == 0 and ha.stats.launches == 4 * 3 * (4 * CFG.layers + 1)


@gpu
def test_sampled_runs_repeat_bit_for_bit_on_cuda():
    """Unsampled launches on torch's GEMM, sampled ones on the checked kernel: with a fixed probability
    the seeded coin picks the same launches, so a run repeats itself bit for bit."""
    cfg = {"sample_prob": 0.3, "overhead_budget": None}
    with deterministic():
        la, pa, ha = train(4, cfg)
        lb, pb, hb = train(4, cfg)
    assert torch.equal(la.view(torch.int32), lb.view(torch.int32))
    assert all(torch.equal(pa[n].view(torch.int16), pb[n].view(torch.int16)) for n in pa)
    assert 0 < ha.stats.checked == hb.stats.checked < ha.stats.launches and ha.stats.confirmed == 0


@gpu
def test_step_boundary_waits_for_the_checks_not_for_the_device():
    """The boundary waits for each check's own end event, so work queued after the step's last check
    is still running when step() returns (the optimizer's launches follow at once); every check is
    read, and a flagged launch is still copied there (test_control.py covers the copies)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(CUDA, torch.bfloat16)
    h = instrument(model, SensorConfig(sample_prob=1.0, overhead_budget=None, seed=1))
    x = torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    model(x).float().square().mean().backward()
    torch.cuda._sleep(400_000_000)  # about 0.2 s of GPU work after the last check
    after = torch.cuda.Event()
    after.record()
    h.step()
    busy = not after.query()
    torch.cuda.synchronize()
    assert busy and h.stats.checked == 6 and not h.unread and h.stats.confirmed == 0
    uninstrument(model)


@gpu
def test_pinned_kernels_surface_a_boundary_later_without_draining():
    """Fingerprinted blocks run every GEMM on the checked kernel (pinned), no GEMM sampled: the boundary
    records an event after them instead of synchronising (work queued after the step still runs when
    step() returns), and the next boundary waits for it; flush waits for the last."""
    model = cuda_gpt(checkpointing=True)
    h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None))
    h.controller.want = lambda op: op.startswith("ckpt/")  # every region fingerprinted, no GEMM sampled
    data = batches(CFG, 8)
    for _ in range(2):
        x, y = on_cuda(next(data))
        model(x, y)[1].backward()
        torch.cuda._sleep(400_000_000)  # about 0.2 s of GPU work after the step's kernels
        after = torch.cuda.Event()
        after.record()
        h.step()
        assert not after.query() and len(h.pinned_marks) == 1
    uninstrument(model)
    assert not h.pinned_marks and h.stats.checked == 0 and h.stats.fingerprinted == 2 * CFG.layers


@gpu
def test_handles_share_each_gpus_identity_not_its_device(monkeypatch):
    """NVML is read once per GPU per process (it is what making a CudaDevice costs); each handle still
    has a Device of its own (``poison``, the kernel choice)."""
    from aegis_cli.backends import cuda
    from aegis_cli.sensors import handle

    real, reads = cuda.device_identity, []
    monkeypatch.setattr(handle, "_IDENTITIES", {})
    monkeypatch.setattr(cuda, "device_identity", lambda i: reads.append(i) or real(i))
    x = torch.randn(4, 8, device=CUDA)
    devices = []
    for _ in range(2):
        model = torch.nn.Linear(8, 8).to(CUDA)
        devices.append(instrument(model, SensorConfig()).device_for(x))
        uninstrument(model)
    assert reads == [0] and devices[0] is not devices[1] and devices[0].identity is devices[1].identity


@gpu
def test_200_clean_steps_confirm_nothing():
    """Every launch checked, every block's recompute fingerprinted: suspicions may be raised
    (and are counted), none is confirmed or dropped."""
    losses, _, h = train(200, {**EVERY, "queue_size": 64}, checkpointing=True, lr=3e-3)
    s = h.stats_dict()
    print(f"200 clean CUDA steps: {s['launches']} checked GEMMs, {s['fingerprinted']} regions; raised {s['raised']}, "
          f"cleared {s['cleared']}, confirmed {s['confirmed']}, dropped {s['dropped']}; largest clean difference "
          f"{s['clean_max_ratio']:.3g}×τ; sense {s['sense_s']:.2f} s, verify {s['verify_s']:.2f} s")
    assert len(losses) == 200
    assert s["confirmed"] == 0 and s["dropped"] == 0, s
    assert s["cleared"] == s["raised"] and s["checked"] == s["launches"] > 0
    assert s["fingerprinted"] == 200 * CFG.layers and s["skipped_nonfinite"] == 0
    assert h.last_clean_step == 199 and float(losses[-10:].mean()) < float(losses[:10].mean()) - 0.5


@gpu
def test_budgeted_sampling_on_cuda():
    """The default config: a 1% budget measured on the GPU's step time (the step boundary
    synchronises) lowers the probabilities; every operator was checked (the first step checks all)."""
    _, _, h = train(30, {})
    s = h.stats_dict()
    probs = [o["prob"] for o in s["operators"].values()]
    assert s["confirmed"] == 0 and 0 < s["checked"] < s["launches"] == 30 * 3 * (4 * CFG.layers + 1), s
    assert all(o["checked"] >= 1 and o["cost_s"] > 0 for o in s["operators"].values()) and min(probs) < 1
    assert s["sense_s"] > 0 and s["step_s"] > s["sense_s"]


@gpu
def test_accumulator_fault_is_caught_confirmed_saved_and_replayed_on_cuda(tmp_path, capsys):
    from aegis_cli.backends.cuda import CudaDevice
    from aegis_cli.vtask.bundle import read_bundle

    model = cuda_gpt()
    w = model.blocks[1].mlp.fc.weight.detach().clone()
    h = instrument(model, SensorConfig(**EVERY, inject=FAULT, bundle_dir=str(tmp_path), job="gpu-test"))
    x, y = on_cuda(next(batches(CFG, 8)))
    _, loss = model(x, y)
    loss.backward()
    action = h.step()
    uninstrument(model)
    assert action is Action.STOP
    confirmed = [e for e in h.events if e.kind == "confirmed"]
    assert len(confirmed) == 1 and h.stats.saved == 1, [e.summary for e in h.events]
    ev = confirmed[0]
    assert ev.op == "blocks.1.mlp.fc" and ev.check == "gemm.row_checksum" and ev.severity == "FAULTY" and ev.step == 0
    e0 = ev.evidence[0]
    assert e0.injected and e0.kernel.endswith("+inject") and e0.recompute["beyond_bound"] > 0 and e0.sms
    vt = read_bundle(ev.bundle).vtasks[0]
    assert vt.case_id == f"train/blocks.1.mlp.fc/fwd/{8 * CFG.seq}x{4 * CFG.dim}x{CFG.dim}"
    assert vt.provenance["device_id"] == "cuda:0" and vt.provenance["gpu_uuid"] == CudaDevice(0).identity.uuid
    assert vt.provenance["injected"] is True and torch.equal(vt.tensors["b"].view(torch.int16), w.cpu().view(torch.int16))

    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", CUDA, "--inject", FAULT, "--format", "json", "-q")
    assert code == 2 and '"outcome": "reproduced"' in out, out[-2000:]
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", CUDA, "--format", "json", "-q")
    assert code == 0 and '"outcome": "not_reproduced"' in out, out[-2000:]


@gpu
def test_flip_in_a_checkpointed_activation_is_caught_on_cuda():
    model = cuda_gpt(checkpointing=True)
    h = instrument(model, SensorConfig(**EVERY, inject="memflip:op=ckpt/blocks.0,bit=hi-mant"))
    x, y = on_cuda(next(batches(CFG, 8)))
    _, loss = model(x, y)
    loss.backward()
    action = h.step()
    uninstrument(model)
    ev = [e for e in h.events if e.kind == "confirmed"]
    assert action is Action.STOP and len(ev) == 1, [e.summary for e in h.events]
    assert ev[0].check == SAVED_INPUT and ev[0].site == "ckpt/blocks.0" and ev[0].severity == Verdict.FAULTY.value


# ------------------------------------------------------------------ the training-state guard
def _guard_run(inject=None, steps: int = 10):
    """The tiny GPT in fp32 (bf16 checked GEMMs) with sensors on, under the guard."""
    torch.manual_seed(0)
    model = cuda_gpt(dtype=torch.float32, cfg=GPTConfig(vocab=128, seq=32, layers=2, heads=2, dim=64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    h = instrument(model, SensorConfig(**EVERY))

    def step_fn(m, o, batch):
        x, y = batch
        o.zero_grad(set_to_none=True)
        _, loss = m(x, y)
        loss.backward()
        assert h.step() is Action.CONTINUE
        o.step()
        return loss.item()

    guard = TrainingGuard(model, opt, step_fn, inject=inject)
    data = batches(model.cfg, 4, seed=3)
    with deterministic():
        losses = [guard.step(on_cuda(next(data))) for _ in range(steps)]
    uninstrument(model)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [t.clone() for st in opt.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
    return losses, state, moments, guard


@gpu
def test_guard_recovers_bit_exactly_on_cuda():
    clean, p0, m0, g0 = _guard_run()
    losses, p1, m1, guard = _guard_run("stateflip:target=exp_avg_sq,step=6,bit=30,op=blocks.0.mlp.fc.weight")
    assert g0.events == [] and len(guard.events) == 1
    ev = guard.events[0]
    assert ev.outcome == "recovered" and ev.step == 6 and ev.restored_to == 4 and ev.replayed == [5, 6]
    assert ev.violations[0].check == "train.adam_exp_avg_sq" and ev.device == "cuda:0"
    assert losses == clean  # the loss curve after recovery is the clean one, bit for bit
    assert all(torch.equal(p0[n], p1[n]) for n in p0) and all(torch.equal(a, b) for a, b in zip(m0, m1, strict=True))


@gpu
def test_guard_with_dropout_and_batchnorm_recovers_bit_exactly_on_cuda():
    """CUDA's random state (dropout) and BatchNorm's running statistics are restored too."""

    def run(inject=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)).to(CUDA)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step_fn(m, o, batch):
            x, y = batch
            o.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss.item()

        guard = TrainingGuard(model, opt, step_fn, inject=inject)
        g = torch.Generator().manual_seed(1)
        torch.cuda.manual_seed(123)
        losses = []
        for _ in range(12):
            x = torch.randn(32, 8, generator=g) * 3 + 1
            losses.append(guard.step(on_cuda((x, (x[:, :1] * 2 - x[:, 1:2]).sin()))))
        return losses, model.state_dict(), guard

    clean, s0, g0 = run()
    losses, s1, guard = run("stateflip:target=exp_avg,step=6,bit=30,op=4.weight")
    # the injected event; any other (a BatchNorm bound on cuDNN's variances) would show in both runs
    assert [e.step for e in guard.events if e.injected] == [6] and len(guard.events) == len(g0.events) + 1
    ev = next(e for e in guard.events if e.injected)
    assert ev.outcome == "recovered" and ev.violations[0].check == "train.adam_exp_avg"
    assert losses == clean and all(torch.equal(s0[k], s1[k]) for k in s0)

"""instrument()/uninstrument(): an instrumented model trains like the plain one within bf16
tolerance, repeats itself bit for bit, and is restored exactly."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from aegis_cli.ops.errors import ConfigError, InjectSpecError
from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from tests.sensors.tiny import MICRO, batches, gpt, grads, inputs, mlp

EVERY = SensorConfig(overhead_budget=None)  # check every launch


def loss_and_grads(model, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), grads(model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_instrumented_model_matches_the_plain_one_within_bf16_tolerance():
    model = gpt()
    x, y = next(batches())
    loss0, g0 = loss_and_grads(model, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the plain model's own bf16 arithmetic, for scale
        loss_bf, g_bf = loss_and_grads(model, x, y)
    h = instrument(model, EVERY)
    loss1, g1 = loss_and_grads(model, x, y)
    assert h.step() is Action.CONTINUE
    uninstrument(model)
    assert h.stats.launches == 3 * 9 and h.stats.checked == 27 and h.stats.confirmed == h.stats.raised == 0
    # bf16 operands (u = 2⁻⁸) through a few layers: the loss within 1%, each gradient within 5% in norm,
    # and no further from fp32 than torch's own bf16 autocast, give or take a factor of 3
    assert abs(float(loss1 - loss0)) <= 1e-2 * abs(float(loss0))
    for name, g in g0.items():
        assert rel(g1[name], g) < 5e-2, name
        assert rel(g1[name], g) <= 3 * rel(g_bf[name], g) + 1e-3, name
    assert abs(float(loss1 - loss0)) <= 3 * abs(float(loss_bf - loss0)) + 1e-4


def train(steps: int, dtype=torch.float32, **cfg) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict]:
    model = gpt().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = instrument(model, SensorConfig(overhead_budget=None, **cfg))
    data, losses = batches(), []
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        h.step()
        opt.step()
        losses.append(loss.detach())
    uninstrument(model)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, h.stats_dict()


def test_repeated_runs_are_bit_identical():
    la, pa, sa = train(3)
    lb, pb, _ = train(3)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(pa[n].view(torch.int32), pb[n].view(torch.int32)) for n in pa)
    assert sa["launches"] == 81 and sa["confirmed"] == 0


def test_bf16_parameters_train_too():
    losses, params, stats = train(3, dtype=torch.bfloat16)
    assert all(torch.isfinite(v).all() and v.dtype == torch.float32 for v in losses)  # the loss is taken in fp32
    assert all(p.dtype == torch.bfloat16 for p in params.values()) and stats["confirmed"] == 0


def test_uninstrument_restores_the_model_exactly():
    model = mlp()
    plain = copy.deepcopy(model)
    instrument(model, EVERY)
    assert "forward" in model.fc1.__dict__
    x = inputs()
    model(x).sum().backward()
    uninstrument(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    model.zero_grad(set_to_none=True)
    assert torch.equal(model(x), plain(x))
    assert uninstrument(model) is None  # not instrumented any more: nothing to do


def test_a_linear_whose_forward_was_replaced_on_the_instance_is_left_alone():
    """A wrapper installed on the instance (accelerate's offload hooks, a scaling adapter) is part of
    what the layer computes: routing the layer's own GEMM would bypass it."""
    model = mlp()
    inner = model.fc2.forward
    own = model.fc2.forward = lambda x: 2 * inner(x)
    x = inputs()
    with torch.no_grad():
        want = model(x)
        h = instrument(model, EVERY)
        got = model(x)
    uninstrument(model)
    assert model.fc2.forward is own and h.stats_dict()["unchecked_modules"] == ["fc2"]
    assert rel(got, want) < 1e-2  # the wrapper's doubling kept (bf16 GEMMs in fc1 and head)


def test_hugging_face_style_checkpoint_attribute_is_wrapped_and_restored():
    model = gpt(checkpointing=True)
    inner = model._gradient_checkpointing_func
    h = instrument(model, EVERY)
    assert model._gradient_checkpointing_func is not inner
    x, y = next(batches())
    _, loss = model(x, y)
    loss.backward()
    h.step()
    uninstrument(model)
    assert model._gradient_checkpointing_func is inner
    # each block's forward ran twice (forward, recompute): both fingerprinted, and they agreed
    assert h.stats.regions == h.stats.fingerprinted == MICRO.layers and h.stats.raised == 0
    assert h.stats.launches == 3 * 9 + 4 * MICRO.layers  # the recompute runs each block's 4 forward GEMMs again
    assert set(h.controller.ops) >= {"ckpt/blocks.0", "ckpt/blocks.1"}


def test_instrument_twice_and_bad_configs_are_refused():
    model = mlp()
    instrument(model, EVERY)
    with pytest.raises(ConfigError, match="already instrumented"):
        instrument(model, EVERY)
    uninstrument(model)
    for bad in ({"sample_prob": 1.5}, {"device": "tpu"}, {"queue_size": 0}, {"overhead_budget": 0.0}, {"rank": -1},
                {"decay": float("nan")}, {"reruns": True}):
        with pytest.raises(ConfigError):
            SensorConfig(**bad)
    with pytest.raises(InjectSpecError):
        SensorConfig(inject="bitflip:bogus=1")


def test_empty_inputs_and_eval_mode_run():
    model = mlp()
    h = instrument(model, EVERY)
    assert model(torch.empty(0, 32)).shape == (0, 8)
    with torch.no_grad():
        assert model(inputs()).shape == (4, 16, 8)
    assert h.stats.launches == 3  # the empty input ran the plain Linear, the no-grad one only forwards
    uninstrument(model)


def test_autocast_keeps_the_checked_gemm_precision():
    model = mlp()
    x = inputs()
    h = instrument(model, SensorConfig(overhead_budget=None))  # the production τ: 3.5× the clean noise
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    h.step()
    uninstrument(model)
    assert out.dtype == torch.bfloat16 and h.stats.raised == 0  # autocast did not leak into the fp32 accumulator


@pytest.mark.parametrize("make", [mlp, lambda: gpt(checkpointing=True), lambda: torch.nn.Linear(32, 8)],
                         ids=["mlp", "checkpointing-attribute-on-the-model", "a-bare-linear"])
def test_a_model_dropped_without_uninstrument_is_not_kept_alive(make):
    model = make()
    h = instrument(model, EVERY)
    out = model(*next(batches())) if hasattr(model, "blocks") else (model(inputs()),)  # (logits, loss) or (y,)
    out[-1].sum().backward()
    del out
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and h.model is None


def test_linear_subclasses_with_a_forward_of_their_own_are_left_alone():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Scaled(8, 4))
    h = instrument(model, EVERY)
    model(torch.randn(3, 8)).sum().backward()
    uninstrument(model)
    assert "forward" not in model[1].__dict__ and h.stats_dict()["unchecked_modules"] == ["1"]
    assert h.stats.launches == 2  # the plain Linear's forward and wgrad (its input needs no gradient: no dgrad)


def test_unsampled_launches_skip_the_checked_gemm_and_give_the_same_bits_on_the_cpu():
    """The controller decides first: an unsampled launch runs the plain product (on the CPU path the
    one the CPU checked GEMM forms, bit for bit), so losses and parameters do not depend on sampling."""
    never = {"sample_prob": 0.0, "coverage_steps": None}
    la, pa, sa = train(3)
    lb, pb, sb = train(3, **never)
    assert sb["launches"] == sa["launches"] == 81 and sb["checked"] == 0 and sa["checked"] == 81
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(la, lb, strict=True))
    assert all(torch.equal(pa[n].view(torch.int32), pb[n].view(torch.int32)) for n in pa)


def test_fingerprinted_regions_pin_every_gemm_to_the_checked_kernel(monkeypatch):
    """Inside a fingerprinted region (forward and recompute) every GEMM runs the checked kernel, sampled
    or not: on a GPU its bits differ from torch's GEMM, and the recompute must repeat the forward."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.sensors import sense

    pinned, plain = [], []
    real_launch, real_plain = sense.launch, CpuDevice.plain_gemm
    monkeypatch.setattr(sense, "launch", lambda *a: pinned.append(a[3]) or real_launch(*a))
    monkeypatch.setattr(CpuDevice, "plain_gemm", lambda *a: plain.append(1) or real_plain(*a))
    model = gpt(checkpointing=True)
    # p = 0, but every operator due at its first launch of each step: each region is fingerprinted, each
    # GEMM compared once; a block's recompute repeats its forward GEMMs, unsampled, yet on the checked kernel
    h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=1))
    x, y = next(batches())
    _, loss = model(x, y)
    loss.backward()
    h.step()
    uninstrument(model)
    assert h.stats.fingerprinted == MICRO.layers and h.stats.checked == 3 * 9 and h.stats.raised == 0
    assert len(pinned) == 3 * 9 + 4 * MICRO.layers and not plain


def test_a_layer_with_nothing_sampled_runs_torchs_own_linear(monkeypatch):
    """Where the layer computes in bf16 on a GPU the sensors run on (``draws_at_forward``, forced here
    on the CPU), its three launches are drawn at the forward: with none sampled it is torch's Linear,
    bit for bit the uninstrumented model, each launch still counted; sampled, the checked path."""
    from aegis_cli.sensors import linear

    monkeypatch.setattr(linear, "draws_at_forward", lambda h, x, *tensors: True)
    model = gpt().to(torch.bfloat16)
    x, y = next(batches())
    want_loss, want_grads = loss_and_grads(model, x, y)
    h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None))
    loss, g = loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)
    assert torch.equal(loss.view(torch.int32), want_loss.view(torch.int32))
    assert all(torch.equal(g[n].view(torch.int16), want_grads[n].view(torch.int16)) for n in g)
    assert h.stats.launches == 3 * 9 and h.stats.checked == 0
    h = instrument(model, EVERY)
    loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)
    assert h.stats.launches == h.stats.checked == 3 * 9 and h.stats.raised == 0


def test_the_bias_inside_the_function_is_linears():
    """The CUDA fast path's form (a layer with some launch sampled, its bias inside the function):
    an unsampled forward is F.linear's own addmm, bit for bit; a sampled one adds the bias after the
    checked GEMM; the bias's gradient is the sum autograd forms; x and W get theirs within bf16."""
    import torch.nn.functional as F

    from aegis_cli.sensors.linear import CheckedLinearFunction, _Site

    model = mlp()
    h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None))
    site = _Site(h, "probe")
    g = torch.Generator().manual_seed(2)
    x0, w0, b0 = (torch.randn(s, generator=g).to(torch.bfloat16) for s in ((3, 8, 32), (16, 32), (16,)))
    want = [t.clone().requires_grad_() for t in (x0, w0, b0)]
    y_want = F.linear(*want)
    y_want.float().square().sum().backward()
    for decided in ((False, True, False), (True, False, True)):
        got = [t.clone().requires_grad_() for t in (x0, w0, b0)]
        y = CheckedLinearFunction.apply(*got, site, torch.bfloat16, decided)
        y.float().square().sum().backward()
        if not decided[0]:
            assert torch.equal(y, y_want)
        assert rel(y.detach(), y_want.detach()) < 2e-2
        assert torch.allclose(got[2].grad.float(), want[2].grad.float(), rtol=2e-2, atol=1e-2)
        assert all(rel(a.grad, b.grad) < 3e-2 for a, b in zip(got[:2], want[:2], strict=True))
    assert h.stats.checked == 3  # the three sampled launches were compared (CPU: at once)
    uninstrument(model)

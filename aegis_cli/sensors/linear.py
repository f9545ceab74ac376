"""``nn.Linear`` through checked GEMMs (docs/sensors.md §1): a custom autograd function runs the
forward, dgrad and wgrad GEMMs of a Linear on the device's checked GEMM, in the layouts training
stores them in (ops/gemm.py ``Layout``):

  forward  Y  = X·Wᵀ    A = X  (tokens × in),   B = W stored (out × in)
  dgrad    dX = dY·W    A = dY (tokens × out),  B = W (out × in)
  wgrad    dW = dYᵀ·X   A = dY stored (tokens × out), B = X (tokens × in)

bf16 operands, fp32 accumulation, bf16 results cast to the model's dtype: the arithmetic of a
bf16 training step. A checked ``forward`` is set on the instance (the class and its code are
untouched); ``restore`` deletes it again. Where the result is bf16 the bias goes into the
function, which returns its gradient itself (g2.sum(0), as autograd derives it for a bias added
outside): a pinned, unsampled forward on CUDA adds it in the checked kernel's epilogue, with the
bits of the add it replaces (docs/sensors.md §2.1); elsewhere it is added after the GEMM. Other
result dtypes add it outside the function, as before.

On a CUDA device, where the layer already computes in bf16 (bf16 tensors, or autocast to bf16),
the layer's three launches are decided at its forward; when none is sampled it runs torch's own
Linear, exactly as uninstrumented: an unsampled layer costs a few coin draws and nothing else.
When some are, the bias goes into the function: an unsampled forward is then torch's Linear
forward (cuBLAS with the bias fused, as uninstrumented) instead of a GEMM and a separate add over
the whole output, and the function returns the bias's gradient itself.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from aegis_cli.ops.gemm import Layout
from aegis_cli.sensors.sense import op_key, run_gemm

BF16 = torch.bfloat16


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``x``'s device, else None."""
    kind = x.device.type
    try:
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    except (TypeError, AttributeError, RuntimeError):  # a torch without the per-device queries, or no autocast there
        return None


def draws_at_forward(h, x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether a launch on ``x`` may be drawn at its forward and, unsampled, run torch's own kernels:
    a CUDA device the sensors run on, outside pinned regions and self-tests (where bits must not
    depend on the coin), computing in bf16 (autocast's, or ``x`` and ``tensors`` bf16; None skipped).
    Shared by the Linear's and the attention's fast paths."""
    if not (x.is_cuda and h.sensing and not h.pinned and h.fault_plan is None and h.config.device == "auto"):
        return False
    return _autocast_dtype(x) == BF16 or all(t.dtype == BF16 for t in (x, *tensors) if t is not None)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would return: autocast's where it is on for ``x``'s device."""
    return _autocast_dtype(x) or x.dtype


class _Site:
    """One Linear's three GEMMs, named by its module path."""

    def __init__(self, h, layer: str):
        self.h, self.layer = h, layer
        self.keys = {lay: op_key(layer, lay) for lay in Layout}

    def gemm(self, layout: Layout, a: torch.Tensor, b: torch.Tensor, sampled: bool | None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        return run_gemm(self.h, self.layer, layout, a.to(BF16).contiguous(), b.to(BF16).contiguous(), sampled, bias)

    @staticmethod
    def linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """torch's Linear forward of bf16 operands (an unsampled forward on the fast path): cuBLAS
        with the bias fused into the GEMM, as F.linear (autocast's or not) computes it."""
        with torch.autocast(x2.device.type, enabled=False):
            return torch.addmm(bias.to(BF16), x2.to(BF16), weight.to(BF16).t())

    def draw(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool, bool] | None:
        """Decide the layer's forward, dgrad and wgrad launches now, each by the controller (the ones
        autograd will run: dgrad when ``x`` needs a gradient, wgrad when the weight does); counted
        as launched. None when none is sampled."""
        grad = torch.is_grad_enabled()
        runs_dgrad, runs_wgrad = grad and x.requires_grad, grad and weight.requires_grad
        want = lambda layout: self.h.controller.want(self.keys[layout])
        fwd = want(Layout.FWD)
        dgrad = runs_dgrad and want(Layout.DGRAD)
        wgrad = runs_wgrad and want(Layout.WGRAD)
        self.h.stats.launches += 1 + runs_dgrad + runs_wgrad
        return (fwd, dgrad, wgrad) if fwd or dgrad or wgrad else None


class CheckedLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ (+ bias, given only for a bf16 result) with forward, dgrad and wgrad on the checked
    GEMM. ``decided``: the three launches' sampling, drawn at forward time (None: each launch asks
    the controller itself)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: _Site, out_dtype: torch.dtype,
                decided: tuple[bool, bool, bool] | None) -> torch.Tensor:
        x2, shape = x.reshape(-1, x.shape[-1]), (*x.shape[:-1], weight.shape[0])  # (tokens, in); Y's
        ctx.save_for_backward(x, weight)
        ctx.site, ctx.decided = site, decided
        ctx.bias_dtype = None if bias is None else bias.dtype
        if bias is not None and decided is not None and not decided[0]:
            return site.linear(x2, weight, bias).to(out_dtype).reshape(shape)
        b = None if bias is None else bias.to(BF16)  # (out,): C + b as a bf16 add, or in the kernel's epilogue
        return site.gemm(Layout.FWD, x2, weight, decided and decided[0], b).to(out_dtype).reshape(shape)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        site: _Site = ctx.site
        decided = ctx.decided
        g2 = gy.reshape(-1, weight.shape[0])  # (tokens, out)
        dx = dw = db = None
        if ctx.needs_input_grad[2]:  # as autograd derives it for the bias added outside
            db = g2.sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            dx = site.gemm(Layout.DGRAD, g2, weight, decided and decided[1]).to(x.dtype).reshape(x.shape)  # (tokens, in)
        if ctx.needs_input_grad[1]:
            dw = site.gemm(Layout.WGRAD, g2, x.reshape(-1, x.shape[-1]), decided and decided[2]).to(weight.dtype)  # (out, in)
        return dx, dw, db, None, None, None


def _checked_forward(site: _Site, original):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0 or self.weight.numel() == 0:  # an empty GEMM: nothing to check, and kernels refuse it
            return original(x)
        if draws_at_forward(site.h, x, self.weight, self.bias):  # torch's Linear computes what unsampled would
            decided = site.draw(x, self.weight)
            if decided is None:  # nothing sampled: torch's Linear, as uninstrumented (cuBLAS, fused bias)
                return original(x)
            return CheckedLinearFunction.apply(x, self.weight, self.bias, site, _out_dtype(x), decided)
        out = _out_dtype(x)
        if self.bias is not None and out == BF16:  # the bias inside: fused into a pinned launch's epilogue
            return CheckedLinearFunction.apply(x, self.weight, self.bias, site, out, None)
        y = CheckedLinearFunction.apply(x, self.weight, None, site, out, None)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    return forward


def patchable(module: nn.Linear) -> bool:
    """Whether ``module`` computes what nn.Linear computes. A subclass with a forward of its own (a
    quantised or adapter layer) means something else by its weight, and a forward replaced on the
    instance (accelerate's offload hooks, an adapter) does more than the GEMM: both are left alone."""
    return (type(module).forward is nn.Linear.forward and "forward" not in module.__dict__
            and module.weight.is_floating_point())


def patch(h, module: nn.Linear, layer: str):
    """Route ``module`` (``patchable``) through checked GEMMs; returns the function that restores it."""
    module.forward = types.MethodType(_checked_forward(_Site(h, layer), module.forward), module)
    ref = weakref.ref(module)  # the handle keeps no module alive: its model may be dropped without uninstrument

    def restore() -> None:
        m = ref()
        if m is not None:
            del m.forward

    return restore

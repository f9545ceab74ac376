"""``nn.Linear`` through checked GEMMs (docs/sensors.md §1): a custom autograd function runs the
forward, dgrad and wgrad GEMMs of a Linear on the device's checked GEMM, in the layouts training
stores them in (ops/gemm.py ``Layout``):

  forward  Y  = X·Wᵀ    A = X  (tokens × in),   B = W stored (out × in)
  dgrad    dX = dY·W    A = dY (tokens × out),  B = W (out × in)
  wgrad    dW = dYᵀ·X   A = dY stored (tokens × out), B = X (tokens × in)

bf16 operands, fp32 accumulation, bf16 results cast to the model's dtype: the arithmetic of a
bf16 training step. A checked ``forward`` is set on the instance (the class and its code are
untouched); ``restore`` deletes it again. The bias is added outside the function, so autograd
derives its gradient as for any Linear.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from aegis_cli.ops.gemm import Layout
from aegis_cli.sensors.sense import run_gemm

BF16 = torch.bfloat16


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would return: autocast's where it is on for ``x``'s device."""
    kind = x.device.type
    try:
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    except (TypeError, AttributeError, RuntimeError):  # a torch without the per-device queries, or no autocast there
        pass
    return x.dtype


class _Site:
    """One Linear's three GEMMs, named by its module path."""

    def __init__(self, h, layer: str):
        self.h, self.layer = h, layer

    def gemm(self, layout: Layout, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return run_gemm(self.h, self.layer, layout, a.to(BF16).contiguous(), b.to(BF16).contiguous())


class CheckedLinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ (no bias) with forward, dgrad and wgrad on the checked GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, site: _Site, out_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        c = site.gemm(Layout.FWD, x2, weight)  # (tokens, out)
        ctx.save_for_backward(x, weight)
        ctx.site = site
        return c.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        site: _Site = ctx.site
        g2 = gy.reshape(-1, weight.shape[0])  # (tokens, out)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = site.gemm(Layout.DGRAD, g2, weight).to(x.dtype).reshape(x.shape)  # (tokens, in)
        if ctx.needs_input_grad[1]:
            dw = site.gemm(Layout.WGRAD, g2, x.reshape(-1, x.shape[-1])).to(weight.dtype)  # (out, in)
        return dx, dw, None, None


def _checked_forward(site: _Site, original):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0 or self.weight.numel() == 0:  # an empty GEMM: nothing to check, and kernels refuse it
            return original(x)
        y = CheckedLinearFunction.apply(x, self.weight, site, _out_dtype(x))
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

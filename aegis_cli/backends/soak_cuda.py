"""Checked GEMMs back to back for the burn-in (``aegis scan --soak``), without a host sync per
launch.

``Launcher(device)`` prepares a launch once per operand set (``prepare``) and runs it as often
as the burn-in asks (``run``). On a CUDA GPU each run only enqueues: the same packed launch
(TMA descriptors, grid, the one loader/launcher of loader.py) writing into freshly allocated
outputs, so the result of a recent launch is still there when the burn-in learns, a little
later, that its checks flagged it. Other devices (the CPU reference path) run
``Device.checked_gemm`` itself, which is synchronous anyway.

Faults (``--inject``) act as in ``CudaDevice.checked_gemm``: accumulator faults in the kernels'
injection build (this launch only, then one sync to record where they landed), operand and
output faults through that method's host copies. A launch no fault touches stays asynchronous,
so an intermittent fault (``prob=…``) costs nothing on the launches it skips.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from aegis_cli.backends.base import Device
from aegis_cli.backends.cuda import CTA_TILES, CudaDevice
from aegis_cli.faults.kernel_params import acc_faults, inject_params
from aegis_cli.faults.spec import FaultPlan, LaunchContext
from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.gemm import GemmOperands, GemmResult

_OUTS = slice(2, 6)  # C, row sums, column sums, tile→SM: where CudaDevice.prepare puts them, in args and keep


@dataclass
class Prepared:
    """One operand set made ready to run: the packed launch on a GPU (None on other devices)."""

    ops: GemmOperands
    launch: object | None = None  # cuda._Launch


def _pointers(launch) -> list[int]:
    return [a.value or 0 for a in launch.args[_OUTS]]


def _fresh(launch):
    """``launch`` on torch's current stream, writing into outputs newly allocated there (of the
    same shapes; tile→SM filled with -1, as prepare leaves it), arguments repacked; the launch it
    came from keeps its own."""
    old = launch.keep[_OUTS]
    outs = [torch.empty_like(t) for t in old[:3]] + [torch.full_like(old[3], -1)]
    args = list(launch.args)
    args[_OUTS] = [ctypes.c_void_p(t.data_ptr()) for t in outs]
    keep = list(launch.keep)
    keep[_OUTS] = outs
    return dataclasses.replace(launch, args=args, keep=keep, stream=torch.cuda.current_stream(launch.device_id).cuda_stream)


class Launcher:
    """Runs checked GEMMs on ``device`` for the burn-in; see the module docstring."""

    def __init__(self, device: Device):
        self.device = device
        self.cuda = isinstance(device, CudaDevice)

    def prepare(self, ops: GemmOperands) -> Prepared:
        if not self.cuda:
            return Prepared(ops)
        dev: CudaDevice = self.device  # type: ignore[assignment]
        with torch.cuda.device(dev.torch_device):
            launch = dev.prepare(ops.a, ops.b, ops.layout)
        # the outputs must sit where prepare packed them: _fresh rewrites exactly those arguments
        if _pointers(launch) != [t.data_ptr() for t in launch.keep[_OUTS]]:
            raise DeviceError(f"{dev.identity.id}: the GEMM launch's arguments changed layout; the burn-in cannot repack them")
        return Prepared(ops, launch)

    def run(self, p: Prepared, fault: FaultPlan | None = None, *, op: str = "", clean_median: float | None = None) -> GemmResult:
        """One checked GEMM of ``p``'s operands on torch's current stream; on a GPU enqueued only
        (the caller synchronises), unless a fault fires on this launch."""
        dev = self.device
        if not self.cuda:
            return dev.checked_gemm(p.ops, fault, op=op, clean_median=clean_median)
        if fault is not None:
            ctx = LaunchContext(dev.identity.id, op, dev.tile, None, clean_median)
            if fault.active(ctx, "operands") or fault.active(ctx, "out"):
                return dev.checked_gemm(p.ops, fault, op=op, clean_median=clean_median)  # host copies, synchronous
            acc = acc_faults(fault, ctx, p.ops, CTA_TILES[p.launch.kernel])
            if acc is not None:
                return self._injected(p, fault, ctx, acc)
            fault.launches += 1  # the plan counts launches: an intermittent fault's coin is drawn per launch
        launch = _fresh(p.launch)
        launch.run()
        c, row_sums, col_sums, tile_sm = launch.outputs
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=dev.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{launch.kernel}", injected=fault is not None)

    def _injected(self, p: Prepared, fault: FaultPlan, ctx: LaunchContext, acc) -> GemmResult:
        """A launch an accumulator fault fires on: the injection build, then one sync so the
        plan records the tiles and SMs it hit (as CudaDevice.checked_gemm does)."""
        dev: CudaDevice = self.device  # type: ignore[assignment]
        m, n, _ = p.ops.mnk
        inj, keep = inject_params(acc, m, n, dev.tile, dev.torch_device)
        with torch.cuda.device(dev.torch_device):
            launch = dev.prepare(p.ops.a, p.ops.b, p.ops.layout, variant="inject", inject=inj)
            launch.run()
        dev.synchronize()
        del keep
        c, row_sums, col_sums, tile_sm = launch.outputs
        ctx.tile_sm = tile_sm.cpu().numpy()
        for record in acc.after:
            record(ctx.tile_sm)
        fault.launches += 1
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=dev.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{launch.kernel}+inject", injected=True)

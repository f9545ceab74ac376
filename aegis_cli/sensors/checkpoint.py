"""The recompute sensor (docs/sensors.md §2.2): under activation checkpointing a region's forward
runs twice, once in the forward pass and once when backward recomputes it, on the same saved
inputs with the same random state. A deterministic region gives the same bits both times, so the
fingerprints of its outputs (the end of the recompute chain: a fault anywhere inside reaches them)
must agree; its inputs are fingerprinted too, so that a saved activation whose bits changed while
held is told apart from a computation that went wrong.

A mismatch is a suspicion. The verifier re-runs the region twice more on the saved inputs with the
forward's random state and autocast settings, as the recompute does (before the optimizer step, so
the parameters are those the step used), and decides which run was wrong (``verify_region``). Fingerprints are aegis' 64-bit bitwise fingerprints
taken where the tensors live (backends/fingerprints.py).

``CheckpointSensor`` wraps a checkpoint function (``torch.utils.checkpoint.checkpoint`` or the
Hugging Face ``_gradient_checkpointing_func`` of a layer); recomputation runs to the end of the
region (non-reentrant early stop is switched off for fingerprinted regions), else the end of the
chain would never be recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from aegis_cli.backends import fingerprints
from aegis_cli.faults.stored import stored_faults
from aegis_cli.ops.fingerprint import hex64
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.sensors.queue import Suspicion
from aegis_cli.sensors.snapshot import rng_state, set_rng_state

SAVED_INPUT = "checkpoint.saved_input"
OUTPUT = "checkpoint.output_fingerprint"


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (nested tuples, lists and dicts), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in tensors_in(obj[k])]
    return []


def prints(obj: Any) -> tuple[int, ...]:
    return tuple(fingerprints.device_fingerprint(t.detach()) for t in tensors_in(obj))


@dataclass
class RegionContext:
    """What the verifier needs to re-run a region: the function, its saved inputs (as the
    recompute read them), the forward's random state and autocast settings, and the fingerprints
    of both runs."""

    fn: Any
    args: tuple
    kwargs: dict
    rng: dict  # torch's CPU and CUDA generators' states at the forward (snapshot.rng_state)
    in_fwd: tuple[int, ...]
    in_rec: tuple[int, ...]
    out_fwd: tuple[int, ...]
    out_rec: tuple[int, ...]
    recomputed: list[torch.Tensor] = field(default_factory=list)  # the recompute's outputs, for miscompare records
    autocast: list[tuple[str, bool, torch.dtype]] = field(default_factory=list)  # the forward's, as autocast_state()

    def tensors(self) -> list[torch.Tensor]:
        return tensors_in((self.args, self.kwargs)) + self.recomputed


def autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """(device type, enabled, dtype) of autocast now, for the CPU and CUDA: a re-run under other
    settings computes other bits ([] on a torch without the per-device queries)."""
    kinds = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    try:
        return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]
    except (TypeError, AttributeError, RuntimeError):
        return []


class _Substitute(torch.autograd.Function):
    """``y``'s values with ``x``'s gradient path: an injected flip in a saved input changes what the
    recompute reads, while gradients still reach the real input."""

    @staticmethod
    def forward(ctx, x, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def _inject(h, site: str, args: tuple) -> tuple:
    """Apply the self-test's ``target=mem`` faults to copies of the saved floating-point inputs
    the recompute reads (a flip in a held activation)."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not idx:
        return args
    device = h.device_for(args[idx[0]])
    plan = h.fault_for(device)
    if plan is None or not any(f.target == "mem" for f in plan.faults):
        return args
    copies = {f"arg{i}": args[i].detach().clone(memory_format=torch.contiguous_format) for i in idx}
    if not stored_faults(plan, device.identity.id, site, copies):
        return args
    out = list(args)
    for i in idx:
        out[i] = _Substitute.apply(args[i], copies[f"arg{i}"])
    return tuple(out)


class CheckpointSensor:
    """A checkpoint function with the recompute sensor around each region it runs."""

    def __init__(self, h, inner, owner: str):
        self.h, self.inner, self.owner = h, inner, owner
        functools.update_wrapper(self, inner, assigned=("__doc__",), updated=())

    def region_name(self, fn) -> str:
        for cand in (fn, getattr(fn, "__self__", None), *(getattr(fn, "args", ())[:1])):
            name = self.h.module_name(cand)
            if name is not None:
                return name
        return f"{self.owner or 'region'}#{self.h.next_region()}"

    def __call__(self, fn, *args, **kwargs):
        h = self.h
        name = self.region_name(fn)
        site = f"ckpt/{name}"
        h.stats.regions += 1
        if not (h.config.fingerprints and h.sensing and site not in h.nondeterministic and h.controller.want(site)):
            return self.inner(fn, *args, **kwargs)
        step = h.step_index
        state: dict[str, Any] = {"calls": 0}

        def run(*a, **k):
            state["calls"] += 1
            forward = state["calls"] == 1
            t0 = time.perf_counter()
            if forward:
                state["rng"], state["autocast"] = rng_state([]), autocast_state()
            elif h.fault_plan is not None:  # the recompute, in backward: a self-test may flip a held input
                a = _inject(h, site, a)
            p_in = prints((a, k))
            t1 = time.perf_counter()
            with h.pin():  # the same GEMM kernels in forward, recompute and re-runs, whatever is sampled
                out = fn(*a, **k)
            t2 = time.perf_counter()
            p_out = prints(out)
            spent = (t1 - t0) + (time.perf_counter() - t2)
            h.add_sense_time(spent)
            if forward:
                state.update(inp=p_in, out=p_out, seconds=spent)
                return out
            h.stats.fingerprinted += 1
            h.controller.spent(site, state["seconds"] + spent)
            if state["calls"] == 2 and (p_in, p_out) != (state["inp"], state["out"]):
                ctx = RegionContext(functools.partial(_pinned, h, fn), tuple(a), dict(k), state["rng"], state["inp"], p_in, state["out"], p_out,
                                    [t.detach() for t in tensors_in(out)], state["autocast"])
                check = SAVED_INPUT if p_in != state["inp"] else OUTPUT
                h.raise_suspicion(Suspicion("checkpoint", name, site, step, [check], 1.0, ctx))
            return out

        with torch_checkpoint.set_checkpoint_early_stop(False):
            return self.inner(run, *args, **kwargs)


def _pinned(h, fn, *args, **kwargs):
    """``fn`` run as the region's forward and recompute ran (SensorHandle.pin): the verifier's re-runs."""
    with h.pin():
        return fn(*args, **kwargs)


@dataclass
class RegionOutcome:
    severity: Verdict
    evidence: Evidence
    nondeterministic: bool = False


def _rerun(ctx: RegionContext) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    with torch.random.fork_rng(devices=range(len(ctx.rng.get("cuda", ())))), torch.no_grad(), contextlib.ExitStack() as stack:
        for kind, enabled, dtype in ctx.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        set_rng_state(ctx.rng, [])
        out = ctx.fn(*ctx.args, **ctx.kwargs)
    return prints(out), [t.detach() for t in tensors_in(out)]


def _fp(p: tuple[int, ...]) -> str:
    return ",".join(hex64(x) for x in p[:4])


def verify_region(ctx: RegionContext, region: str, site: str, reruns: int = 2) -> RegionOutcome:
    """Which run of a region was wrong: its saved inputs changed, the forward, or the recompute."""
    base = {"case_id": site, "op": region, "samples": [{"forward": _fp(ctx.out_fwd), "recompute": _fp(ctx.out_rec)}]}
    if ctx.in_fwd != ctx.in_rec:
        return RegionOutcome(Verdict.FAULTY, Evidence(
            check=SAVED_INPUT, severity=Verdict.FAULTY, distinct_outputs=2, **base,
            summary=(f"{SAVED_INPUT}: the saved inputs of {region} read back at the recompute with other bits than at the "
                     f"forward ({_fp(ctx.in_fwd)} → {_fp(ctx.in_rec)}): a held activation was corrupted")))
    runs = [_rerun(ctx) for _ in range(max(2, reruns))]
    agree = len({p for p, _ in runs}) == 1
    again, outs = runs[0]
    if not agree:
        return RegionOutcome(Verdict.SUSPECT, Evidence(
            check=OUTPUT, severity=Verdict.SUSPECT, reruns=len(runs), distinct_outputs=len({p for p, _ in runs}), **base,
            summary=(f"{OUTPUT}: {region} is not deterministic (re-runs of the same inputs differ), so its recompute cannot "
                     "be compared bit for bit; its fingerprints are switched off")), nondeterministic=True)
    if again not in (ctx.out_fwd, ctx.out_rec):
        return RegionOutcome(Verdict.SUSPECT, Evidence(
            check=OUTPUT, severity=Verdict.SUSPECT, reruns=len(runs), distinct_outputs=3, **base,
            summary=(f"{OUTPUT}: re-runs of {region} agree with each other but with neither the forward nor the recompute: "
                     "its parameters or inputs changed before verification (verify before optimizer.step)")))
    wrong = "recompute" if again == ctx.out_fwd else "forward"
    ev = Evidence(check=OUTPUT, severity=Verdict.FAULTY, reruns=len(runs), reproduced=0, distinct_outputs=2, **base,
                  summary=(f"{OUTPUT}: the {wrong} of {region} gave other bits than {len(runs)} re-runs of the same inputs, "
                           f"which agree with the {'forward' if wrong == 'recompute' else 'recompute'}: the {wrong} was "
                           "corrupted" + (" and its activations fed the rest of the step" if wrong == "forward" else "")))
    if wrong == "recompute":  # where the recompute's outputs differ from the right ones
        for exp, act in zip(outs, ctx.recomputed, strict=False):
            if exp.shape == act.shape and exp.dtype == act.dtype:
                _, count, records = fingerprints.diff_records(exp, act)
                if count:
                    ev.elements, ev.samples = count, base["samples"] + records[:7]
                    break
    return RegionOutcome(Verdict.FAULTY, ev)

"""The gemm probe: a workload's training GEMMs, planned into cases and checked by GemmProbe.

A workload (ops/workloads.py: ``--workload``, else ``cpu-quick`` on CPUs and ``llama3-70b``
on GPUs) gives GEMM shapes, input distributions and power-of-two scales; each (shape,
distribution) is one GemmCase run at every scale (probes/gemm.py checks and confirms it).
Before any probe runs, ``preflight`` refuses a workload, a ``--case`` or a largest case that
could not run on a device; ``count_cases`` is the number of cases the scan's progress counts.
The option ``gemm.shift=A,B`` moves every scale but the base by (A, B): a sweep's scale
dithering (ops/dither.py) sets it, and a case id at a shifted scale re-runs with it.
"""

from __future__ import annotations

from aegis_cli.backends.base import Device, memory_shortfall
from aegis_cli.ops import dither, workloads
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Evidence
from aegis_cli.probes import ProbeConfig, ProbeContext, convert_option, register, workload_for
from aegis_cli.probes.gemm import GemmCase, GemmProbe, case_bytes

OPTIONS = {"shift": (dither.parse_pair, (0, 0), "move every scale but (0, 0) by A,B: a sweep's scale dithering (docs/fleet.md)")}


def scales_for(wl: workloads.Workload, config: ProbeConfig) -> list[list[int]]:
    """The scale pairs the probe runs: the workload's, moved by ``gemm.shift``."""
    raw = config.probe_options.get("gemm.shift")
    return wl.scan.scales if raw is None else dither.shifted(wl.scan.scales, convert_option("gemm", "shift", raw))


def plan_cases(wl: workloads.Workload, seed: int, case: str | None = None) -> list[GemmCase]:
    cases = [GemmCase(wl.name, shape, dist, seed) for shape in wl.gemms() for dist in wl.scan.distributions]
    if case is not None:
        cid = CaseId.parse(case)
        cases = [c for c in cases if cid.extends(c.group_id)]
        if not cases:
            raise ConfigError(f"case {case!r} is not in workload {wl.name!r} (case ids look like "
                              f"{wl.name}/OP/LAYOUT/DIST/MxNxK/s+0+0)")
        if cid.scale is None:  # a case's group: the scan would run nothing of it and say HEALTHY
            raise ConfigError(f"case {case!r} names no scale (case ids end in one, e.g. {cases[0].case_id(0, 0)})")
    return cases


def case_scales(base: list[list[int]], case: str | None) -> list[list[int]]:
    """The scales a scan runs: ``base`` (the workload's, moved by ``gemm.shift``), and a ``--case``'s
    own scale beyond them (a burn-in launch of ``aegis scan --soak`` or a sweep's dithered case runs
    at any scale where scaling its inputs is exact; the probe refuses one where it is not)."""
    scales = [list(s) for s in base]
    scale = CaseId.parse(case).scale if case else None
    if scale is not None and list(scale) not in scales:
        scales.append(list(scale))
    return scales


def planned_runs(wl: workloads.Workload, config: ProbeConfig) -> list[tuple[GemmCase, list[str]]]:
    """Each case the probe runs, with the case ids it runs it at: every scale (moved by
    ``gemm.shift``), or with a ``--case`` that case and the base scale it is checked against."""
    scales = case_scales(scales_for(wl, config), config.case)
    out = []
    for c in plan_cases(wl, config.seed, config.case):
        ids = [c.case_id(ea, eb) for ea, eb in scales]
        out.append((c, ids if config.case is None else [i for i in ids if i in (config.case, c.case_id(0, 0))]))
    return out


def preflight(devices: list[Device], ctx: ProbeContext) -> None:
    """Refuse, before any work, a GEMM case that could not fit in a device's memory: the OOM
    killer would end the scan with no report and no exit code of ours, and a CUDA out-of-memory
    error half-way would mark a sound GPU ERROR. Two cases, two remedies: the device is too
    small for the workload (lower its sizes), or other processes hold the memory now (retry
    when the device is idle). Loading the workload and planning the cases refuses a bad
    workload or ``--case`` on the way."""
    config = ctx.config
    for d in devices:
        wl = workload_for(config, d)
        big = max({c.shape for c in plan_cases(wl, config.seed, config.case)}, key=lambda s: case_bytes(s.m, s.n, s.k))
        need = case_bytes(big.m, big.n, big.k)
        short = memory_shortfall(d, need)
        if short is not None:
            remedy = "lower scan.max_tokens or the model's sizes" if short[0] == "small" else "run the scan when the device is idle"
            raise ConfigError(f"workload {wl.name!r}: its largest GEMM ({big.op} {big.layout.value} {big.m}x{big.n}x{big.k}) "
                              f"needs about {need / 2**30:.1f} GiB on {d.identity.id}, {short[1]}; {remedy}")


def count_cases(devices: list[Device], config: ProbeConfig) -> int:
    """The cases the probe will run (one progress "case" each) over ``devices``."""
    return sum(len(ids) for d in devices for _, ids in planned_runs(workload_for(config, d), config))


@register("gemm", OPTIONS, preflight=preflight, count_cases=count_cases)
def gemm_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Checked training GEMMs across distributions and power-of-two scales."""
    config = ctx.config
    wl = workload_for(config, device)
    ctx.stats["workload"] = wl.name
    probe = GemmProbe(device, config.thresholds, reruns=config.reruns, fault=ctx.fault, keep_flagged=config.keep_flagged,
                      on_case=lambda cid: ctx.progress("case", device=device.identity.id, case=cid), tally=ctx.tally)
    evidence: list[Evidence] = []
    scales = case_scales(scales_for(wl, config), config.case)
    cases = plan_cases(wl, config.seed, config.case)
    for i, case in enumerate(cases):
        evidence += probe.run(case, scales, only=config.case)
        if ctx.tally.stopped:  # fail-fast: the cases not run are named (the scan counts them as progress)
            probe.skip([c.case_id(ea, eb) for c in cases[i + 1:] for ea, eb in scales])
            break
    ctx.stats["gemm"] = probe.stats
    ctx.captured.update(probe.flagged_runs)
    return evidence

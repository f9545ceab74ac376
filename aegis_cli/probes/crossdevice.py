"""The cross-device probe (docs/design.md §4.1): the same seeded workload on every device of the node.

A node probe: it runs after the per-device probes with all scanned devices. Each device
draws the same seeded inputs and runs the same canonical computations (_common); inputs and
outputs are fingerprinted on the device. Devices of the same backend and model must agree
bit for bit (devices of other models are compared only among themselves).

  crossdevice.mismatch   a device's fingerprint differs from the others'. With three or more
                         devices a strict majority decides and the odd ones are FAULTY.
                         With two (or no majority), the fp64 reference decides for the GEMMs:
                         at the differing elements each device's value is checked against
                         an exact fp64 dot product (outputs; bound: bf16 rounding plus the
                         worst-case fp32 accumulation error) or the fp64 checksum reference
                         (accumulator row/column sums; bound: the scan's τ); the device
                         outside its bound is FAULTY. Undecided → SUSPECT on every device of
                         the disagreeing group (a software or configuration difference, or a
                         fault the reference cannot place).
"""

from __future__ import annotations

import time

import torch

from aegis_cli.backends import fingerprints
from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import recent_injections
from aegis_cli.ops import numerics
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.gemm import GemmOperands, Layout, ReferenceChecksums
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.probes import ProbeContext, register_node
from aegis_cli.probes.computations import COMPUTATIONS, MAX_SAMPLES, assumed_deterministic, computation_list, localise, majority, sizes_for

DEFAULT = "checked_gemm,matmul,sdpa_fwd,rmsnorm,silu"
REFEREE_POSITIONS = 64

OPTIONS = {"only": (computation_list(allow_empty=False), DEFAULT, "comma-separated computations to compare across devices")}


def _groups(devices: list[Device]) -> dict[tuple[str, str], list[Device]]:
    """Devices by (backend, model): only devices of one group are compared with each other."""
    groups: dict[tuple[str, str], list[Device]] = {}
    for d in devices:
        groups.setdefault((d.identity.backend, d.identity.name), []).append(d)
    return groups


def case_ids(name: str) -> list[str]:
    """The case ids the probe gives ``name``'s evidence: one per input and output."""
    inputs, outputs = COMPUTATIONS[name].names
    return [str(CaseId("crossdevice", (name, k))) for k in (*(f"input:{i}" for i in inputs), *outputs)]


def selection(devices: list[Device], ctx: ProbeContext) -> list[str]:
    """The computations to compare: ``only``, or the one of ``--case crossdevice/NAME/KEY``.
    ConfigError, before any work, for a case id the probe never gives (a wrong KEY used to run
    NAME's comparison and say HEALTHY about it), when a group of devices would compare nothing
    (every name differs run to run on its backend), or, run alone, when no two devices are of
    one model: each would read as HEALTHY."""
    from aegis_cli.ops.errors import ConfigError

    names = [n.strip() for n in ctx.option("crossdevice", "only").split(",") if n.strip()]
    name, case = ctx.case_part("crossdevice"), ctx.config.case
    if name is not None:
        if name not in COMPUTATIONS:
            raise ConfigError(f"case {case!r}: the crossdevice probe has no computation {name!r} "
                              f"(known: {', '.join(COMPUTATIONS)})")
        if case not in case_ids(name):
            raise ConfigError(f"case {case!r}: the crossdevice probe has no such case (its cases for {name}: "
                              f"{', '.join(case_ids(name))})")
        names = [name]
    groups = _groups(devices)
    if set(ctx.config.probes) <= {"crossdevice"} and all(len(m) < 2 for m in groups.values()):
        raise ConfigError("crossdevice compares devices of one model with each other; no two of the scanned devices "
                          f"are of one model ({', '.join(m for _, m in groups)}), so alone it checks nothing")
    for (backend, model), members in groups.items():
        if len(members) >= 2 and not any(all(assumed_deterministic(d, n) for d in members) for n in names):
            raise ConfigError(f"crossdevice: {', '.join(names)} differ(s) run to run on a healthy {backend} device, so the "
                              f"probe skips it and would compare nothing on the {model} devices; choose others "
                              "(crossdevice.only)")
    return names


def _run_device(device: Device, names: list[str], ctx: ProbeContext, fault) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        comp = COMPUTATIONS[name]
        x = comp.inputs(device, sizes_for(device), ctx.config.seed)
        res = comp.held(device, x, fault, f"crossdevice/{name}")
        out[name] = {**{f"input:{k}": v for k, v in x.items()}, **res}
        ctx.progress("step", device=device.identity.id, case=f"crossdevice/{name}")
    device.synchronize()
    return out


def _referee(name: str, key: str, results: dict[str, dict], ids: list[str], devices: dict[str, Device],
             thresholds: numerics.Thresholds) -> dict[str, float] | None:
    """Each device's worst error at the differing elements over its rigorous bound (> 1: wrong),
    for GEMM outputs; None when no fp64 reference applies. Checksums are judged on the devices'
    own checksum tile, in units of each device's noise scale and against its τ, as the GEMM probe
    judges them."""
    if name not in ("checked_gemm", "matmul") or key.startswith("input:"):
        return None
    a0, a1 = results[ids[0]][name][key], results[ids[1]][name][key]
    _, _, recs = fingerprints.diff_records(a0, a1, limit=REFEREE_POSITIONS)
    if not recs:
        return None
    a = results[ids[0]][name]["input:a"].cpu().double()  # (M, K); inputs agree (checked first)
    b = results[ids[0]][name]["input:b"].cpu().double()  # (N, K)
    k = a.shape[1]
    out: dict[str, float] = {}
    if key == "c":
        n = a0.shape[1]
        rows = torch.tensor([r["index"] // n for r in recs])
        cols = torch.tensor([r["index"] % n for r in recs])
        exact = (a[rows] * b[cols]).sum(1)
        scale = (a[rows].abs() * b[cols].abs()).sum(1)
        bound = numerics.U_BF16 * exact.abs() + 2 * k * numerics.U_FP32 * scale
        for d in ids:
            got = results[d][name][key].cpu().double().reshape(-1)[torch.tensor([r["index"] for r in recs])]
            ratio = ((got - exact).abs() / bound.clamp(min=numerics.SMALLEST_SCALE)).nan_to_num(nan=float("inf"))
            out[d] = float(ratio.max())
        return out
    tile = devices[ids[0]].tile  # one model per comparison group: one tile
    ops = GemmOperands(a.to(torch.bfloat16), b.to(torch.bfloat16), Layout.FWD)
    idx = torch.tensor([r["index"] for r in recs])
    refs: dict[numerics.NoiseModel, ReferenceChecksums] = {}  # devices of one kind share a noise model: one fp64 reference
    for d in ids:  # each device's differences in units of its own noise scale, as its GEMM probe sees them
        noise_model = devices[d].noise_model(k)
        if noise_model not in refs:
            refs[noise_model] = numerics.reference_checksums(ops, tile, noise_model)
        ref = refs[noise_model]
        want, noise = (ref.row, ref.noise()[0]) if key == "row_sums" else (ref.col, ref.noise()[1])
        if tuple(want.shape) != tuple(a0.shape):  # sums of another layout than this reference's
            return None
        got = results[d][name][key].cpu().double().reshape(-1)[idx]
        diff = numerics.normalised_diff(got, want.reshape(-1)[idx], noise.reshape(-1)[idx], ref.floor)
        out[d] = float(diff.max()) / thresholds.tau
    return out


def _evidence(name: str, key: str, culprit: str, ref_dev: str, results: dict, sev: Verdict, why: str, ctx: ProbeContext,
              device: Device, fault=None) -> Evidence:
    comp = COMPUTATIONS[name]
    loc = localise(results[ref_dev][name][key], results[culprit][name][key],
                   tile=device.tile if key == "c" else None)
    return Evidence(
        check="crossdevice.mismatch", severity=sev, case_id=str(CaseId("crossdevice", (name, key))),
        summary=f"crossdevice.mismatch: {name} {key} on {culprit} differs from {ref_dev}: {loc['elements']} element(s); {why}",
        op=name, shape=comp.shape(sizes_for(device)), dist="normal", seed=ctx.config.seed, max_value=1.0,
        elements=loc["elements"], samples=[{"output": key, "reference_device": ref_dev, **s} for s in loc["samples"][:MAX_SAMPLES]],
        tiles=loc["tiles"][:16], localised=loc["localised"], kernel="aegis" if not comp.vendor else "torch",
        injected=recent_injections(fault))


@register_node("crossdevice", OPTIONS, preflight=selection)
def crossdevice_probe(devices: list[Device], ctx: ProbeContext) -> dict[str, list[Evidence]]:
    """Same seeded workload on every device; the odd one out is flagged."""
    t0 = time.perf_counter()
    names = selection(devices, ctx)  # run_scan checked it before any probe ran
    groups = _groups(devices)
    evidence: dict[str, list[Evidence]] = {d.identity.id: [] for d in devices}
    summary: list[dict] = []
    for (_backend, model), members in groups.items():
        if len(members) < 2:
            summary.append({"model": model, "devices": [d.identity.id for d in members], "compared": False,
                            "reason": "needs at least two devices of the same model"})
            continue
        use = [n for n in names if all(assumed_deterministic(d, n) for d in members)]
        ids = [d.identity.id for d in members]
        by_id = {d.identity.id: d for d in members}
        plans = {i: ctx.fault.for_device(i) if ctx.fault is not None else None for i in ids}
        results = {d.identity.id: _run_device(d, use, ctx, plans[d.identity.id]) for d in members}
        disagreements = []
        bad_inputs: set[str] = set()
        for name in use:
            keys = sorted(results[ids[0]][name], key=lambda k: not k.startswith("input:"))  # inputs first
            for key in keys:
                prints = [fingerprints.device_fingerprint(results[i][name][key]) for i in ids]
                best, odd = majority(prints)
                if not odd:
                    continue
                agree = [ids[j] for j in range(len(ids)) if prints[j] == best]
                disagreements.append({"computation": name, "output": key, "odd": [ids[j] for j in odd]})
                if key.startswith("input:"):
                    bad_inputs.add(name)
                elif name in bad_inputs:
                    continue  # the inputs already differ: the input evidence says where
                if len(agree) > len(ids) / 2 and len(ids) >= 3:
                    for j in odd:
                        evidence[ids[j]].append(_evidence(name, key, ids[j], agree[0], results, Verdict.FAULTY,
                                                          f"{len(agree)} of {len(ids)} {model} devices agree with each other (majority)",
                                                          ctx, by_id[ids[j]], plans[ids[j]]))
                    continue
                ratios = _referee(name, key, results, [agree[0], ids[odd[0]]], by_id, ctx.config.thresholds) if len(set(prints)) == 2 else None
                wrong = [d for d, r in (ratios or {}).items() if r > 1.0]
                if ratios is not None and len(wrong) == 1:
                    right = next(d for d in ratios if d != wrong[0])
                    culprits = [ids[j] for j in range(len(ids)) if prints[j] == prints[ids.index(wrong[0])]]
                    for c in culprits:
                        evidence[c].append(_evidence(name, key, c, right, results, Verdict.FAULTY,
                                                     f"the fp64 reference decides: error {ratios[wrong[0]]:.3g}× its bound here, "
                                                     f"{ratios[right]:.3g}× on {right}", ctx, by_id[c], plans[c]))
                    continue
                why = ("no majority and no fp64 reference for this output" if ratios is None else
                       "the fp64 reference cannot tell which is wrong (" + ", ".join(f"{d}: {r:.3g}× bound" for d, r in ratios.items()) + ")")
                for i in ids:
                    other = agree[0] if i != agree[0] else ids[odd[0]]
                    evidence[i].append(_evidence(name, key, i, other, results, Verdict.SUSPECT, f"undecided: {why}", ctx, by_id[i],
                                                 plans[i]))
        summary.append({"model": model, "devices": ids, "compared": True, "computations": use,
                        "agree": not disagreements, "disagreements": disagreements[:16]})
        del results
    ctx.stats["crossdevice"] = {"groups": summary, "seconds": round(time.perf_counter() - t0, 3)}
    return evidence

"""The golden probe: compare the canonical workloads against fingerprints recorded on a
known-good device of the same model and software stack (aegis_cli/golden.py).

Runs only with ``aegis scan --golden FILE`` (the scan adds it then, and refuses first when
the file has no record for a device's key).

  golden.mismatch   an input or output fingerprint differs from the golden one. The
                    computation is re-run ``min(reruns, 3)`` times. Always FAULTY: the same
                    wrong bits every time (a device wrong the same way every time), or runs
                    that differ among themselves, a bitwise mismatch between runs of a
                    computation recorded only because it is deterministic on a healthy device
                    (docs/design.md §7, as in the determinism probe), even when later runs return to the
                    golden bits. Differing blocks (golden block fingerprints) localise it to
                    element ranges.
"""

from __future__ import annotations

from aegis_cli.backends.base import Device
from aegis_cli.backends.fingerprints import device_block_fingerprints
from aegis_cli.faults.spec import recent_injections
from aegis_cli.ops.case import CaseId
from aegis_cli.ops.errors import ConfigError, GoldenError
from aegis_cli.ops.fingerprint import hex64
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.probes import ProbeContext, register
from aegis_cli.probes import golden_file as golden


def _same_layout(doc: dict, name: str, want: dict, got: dict) -> None:
    """The record must describe the tensors this aegis computes: the same outputs, shapes and
    dtypes. Otherwise the file is for other work (GoldenError), not evidence against the device."""
    for o in sorted(set(want) | set(got)):
        w, g = want.get(o), got.get(o)
        if w is None or g is None or list(w["shape"]) != g["shape"] or w["dtype"] != g["dtype"]:
            have = "none" if w is None else f"{w['dtype']} {w['shape']}"
            made = "none" if g is None else f"{g['dtype']} {g['shape']}"
            raise GoldenError(f"golden file {doc.get('_path', '')}: {name}.{o} was recorded as {have}, this aegis computes "
                              f"{made} — record it again with this aegis")


def preflight(devices: list[Device], ctx: ProbeContext) -> None:
    """Before any probe runs: the golden file reads, and holds a record for every device."""
    if ctx.config.golden:
        golden.check_keys(golden.load(ctx.config.golden), devices)


@register("golden", preflight=preflight)
def golden_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Fingerprints of the canonical workloads against a golden file."""
    only = ctx.case_part("golden")  # --case golden/NAME
    if not ctx.config.golden:
        if only is not None:
            raise ConfigError(f"case {ctx.config.case!r} compares against a golden file: give it with --golden FILE")
        ctx.stats["golden"] = {"compared": False, "reason": "no --golden FILE given"}
        return []
    doc = golden.load(ctx.config.golden)
    rec = golden.match(doc, device)
    seed, block = int(doc["seed"]), int(doc["block"])
    evidence: list[Evidence] = []
    checked = 0
    if only is not None and only not in rec["computations"]:
        raise ConfigError(f"case {ctx.config.case!r}: the golden record {rec['key']!r} has no computation {only!r} "
                          f"(it has: {', '.join(rec['computations'])})")
    for name, want in rec["computations"].items():
        if only is not None and name != only:
            continue
        tensors, got = golden.fingerprint_outputs(device, name, seed, ctx.fault)
        ctx.progress("step", device=device.identity.id, case=f"golden/{name}")
        _same_layout(doc, name, want["outputs"], got)
        bad = [o for o, v in want["outputs"].items() if got[o]["fingerprint"] != v["fingerprint"]]
        checked += len(want["outputs"])
        if not bad:
            continue
        reruns = max(1, min(ctx.config.reruns, 3))
        seen = [tuple(got[o]["fingerprint"] for o in bad)]
        for _ in range(reruns):
            _, again = golden.fingerprint_outputs(device, name, seed, ctx.fault)
            seen.append(tuple(again.get(o, {}).get("fingerprint") for o in bad))
        golden_bits = tuple(want["outputs"][o]["fingerprint"] for o in bad)
        wrong_runs = sum(s != golden_bits for s in seen)
        samples, tiles, elements, n_blocks = [], [], 0, 0
        for o in bad:
            t = tensors[o]
            blocks = got[o]["blocks"] if block == golden.BLOCK else [hex64(b) for b in device_block_fingerprints(t.contiguous(), block)]
            differing = [i for i, (a, b) in enumerate(zip(want["outputs"][o]["blocks"], blocks, strict=False)) if a != b]
            # the file keeps block fingerprints, not values: count the differing blocks' elements
            elements += sum(min(t.numel(), (i + 1) * block) - i * block for i in differing)
            n_blocks += len(differing)
            tiles += [[i] for i in differing[:8]]
            for i in differing[:4]:
                samples.append({"output": o, "block": i, "elements": [i * block, min(t.numel(), (i + 1) * block)],
                                "expected_block_fingerprint": want["outputs"][o]["blocks"][i], "actual_block_fingerprint": blocks[i]})
        if wrong_runs == len(seen) and len(set(seen)) == 1:
            sev, why = Verdict.FAULTY, f"the same wrong bits in all {len(seen)} runs: this device is wrong the same way every time"
        else:  # a deterministic computation changed its bits between runs
            sev, why = Verdict.FAULTY, (f"wrong in {wrong_runs} of {len(seen)} runs, with {len(set(seen))} different results "
                                        "from a computation that is bitwise deterministic on a healthy device")
        evidence.append(Evidence(
            check="golden.mismatch", severity=sev, case_id=str(CaseId("golden", (name,))),
            summary=(f"golden.mismatch: {name}: {', '.join(bad)} differ from the golden fingerprint in {n_blocks} block(s) "
                     f"of {block} elements ({elements} elements in all, an upper bound); {why}"),
            op=name, shape=want["shape"], dist="normal", seed=seed, max_value=1.0, elements=elements, samples=samples[:8],
            tiles=tiles[:16], reruns=reruns, reproduced=wrong_runs - 1, distinct_outputs=len(set(seen)),
            injected=recent_injections(ctx.fault)))
    ctx.stats["golden"] = {"compared": True, "file": ctx.config.golden, "key": rec["key"], "outputs_checked": checked,
                           "mismatches": len(evidence)}
    return evidence

"""Golden fingerprints: canonical workloads recorded on a known-good GPU (docs/design.md §4.1).

A GPU that is wrong the same way every time passes the determinism probe and, alone in its
node, the cross-device probe; only a comparison with a result recorded elsewhere sees it.
``record`` runs the canonical computations (probes/_common.py, those deterministic on the
backend) at a fixed seed and stores each input's and output's fingerprint with its block
fingerprints, keyed by what the bits depend on::

    backend, model (GPU name), driver, cuda (torch's CUDA), torch, kernels (hash of kernels/*.cu),
    gemm_kernel (which CUDA GEMM kernel runs: wgmma and mma sum in different orders)
    (+ threads and cpu_capability on the CPU backend: its float kernels block by thread count
    and take the widest vector instructions the CPU has, AVX-512 or not)

``aegis scan --golden FILE`` refuses (GoldenError) when no record matches a device's key,
naming the fields that differ, then compares (probes/golden.py).

File format (JSON, no pickle)::

    {"format": "aegis-golden", "format_version": 1, "created": ISO-8601, "aegis": version,
     "seed": int, "block": elements per block fingerprint,
     "records": [{"key": {...}, "devices": [uuid, ...], "computations": {NAME: {"shape": {...},
                  "outputs": {OUTPUT: {"fingerprint": hex16, "shape": [...], "dtype": str,
                                       "blocks": [hex16, ...]}}}}}]}
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import torch

from aegis_cli.backends import fingerprints
from aegis_cli.backends.base import Device
from aegis_cli.backends.loader import kernel_hashes
from aegis_cli.ops import fingerprint
from aegis_cli.ops.case import check_seed
from aegis_cli.ops.config import read_input_text
from aegis_cli.ops.errors import ConfigError, GoldenError
from aegis_cli.ops.files import atomic_write
from aegis_cli.ops.provenance import tool_version
from aegis_cli.probes.computations import COMPUTATIONS, assumed_deterministic, sizes_for

FORMAT = "aegis-golden"
FORMAT_VERSION = 1
BLOCK = 1 << 16
GOLDEN_SEED = 20240229
KEY_FIELDS = ("backend", "model", "driver", "cuda", "torch", "kernels", "gemm_kernel", "threads", "cpu_capability")
_HEX64 = re.compile(r"[0-9a-f]{16}")  # fingerprint.hex64's form, compared as text


def device_key(device: Device) -> dict:
    """What a device's canonical fingerprints depend on."""
    ident = device.identity
    kh = hashlib.sha256(json.dumps(kernel_hashes(), sort_keys=True).encode()).hexdigest()[:16]
    key = {"backend": ident.backend, "model": ident.name, "driver": ident.driver, "cuda": torch.version.cuda,
           "torch": torch.__version__, "kernels": kh}
    if ident.backend == "cpu":
        key["threads"] = torch.get_num_threads()
        key["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    elif getattr(device, "kernel", None):
        key["gemm_kernel"] = device.kernel
    return key


def computations_for(device: Device) -> list[str]:
    return [n for n in COMPUTATIONS if assumed_deterministic(device, n)]


def fingerprint_outputs(device: Device, name: str, seed: int, fault=None, op: str = "golden") -> tuple[dict, dict]:
    """Run one canonical computation; ({output: tensor}, {output: record}). Inputs count as
    outputs ("input:a" …): a device whose generator or memory is wrong shows there first."""
    comp = COMPUTATIONS[name]
    x = comp.inputs(device, sizes_for(device), seed)
    out = comp.held(device, x, fault, f"{op}/{name}")
    tensors = {**{f"input:{k}": v for k, v in x.items()}, **out}
    recs = {}
    for k, t in tensors.items():
        blocks = fingerprints.device_block_fingerprints(t, BLOCK)  # one pass: the whole is their sum
        recs[k] = {"fingerprint": fingerprint.hex64(fingerprint.combine(blocks)), "shape": list(t.shape),
                   "dtype": str(t.dtype).replace("torch.", ""), "blocks": [fingerprint.hex64(b) for b in blocks]}
    return tensors, recs


def record(devices: list[Device], seed: int = GOLDEN_SEED, progress=None) -> dict:
    """Fingerprints of the canonical workloads on ``devices`` (assumed known-good). Devices
    sharing a key must agree bit for bit, else GoldenError: nothing trustworthy to record."""
    progress = progress or (lambda *a, **k: None)
    check_seed(seed)
    records: list[dict] = []
    for device in devices:
        key = device_key(device)
        comps = {}
        for name in computations_for(device):
            _, recs = fingerprint_outputs(device, name, seed)
            comps[name] = {"shape": COMPUTATIONS[name].shape(sizes_for(device)), "outputs": recs}
            progress("case", device=device.identity.id, case=f"golden/{name}")
        same = next((r for r in records if r["key"] == key), None)
        if same is None:
            records.append({"key": key, "devices": [device.identity.uuid], "computations": comps})
            continue
        differ = [f"{n}.{o}" for n, c in comps.items() for o, v in c["outputs"].items()
                  if same["computations"].get(n, {}).get("outputs", {}).get(o, {}).get("fingerprint") != v["fingerprint"]]
        if differ:
            raise GoldenError(f"devices with the same key disagree ({device.identity.id} vs {same['devices'][0]}) on "
                              f"{', '.join(differ[:6])}: refusing to record a golden from a node that is not healthy")
        same["devices"].append(device.identity.uuid)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "aegis": tool_version(), "seed": seed, "block": BLOCK, "records": records}


def save(doc: dict, path: str | Path) -> None:
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def load(path: str | Path) -> dict:
    """Read and validate a golden file; GoldenError says what is wrong with it."""
    if not Path(path).exists():
        raise GoldenError(f"golden file {path} not found (record one with `aegis golden record --output FILE`)")
    try:
        doc = json.loads(read_input_text(path))
    except ConfigError as exc:
        raise GoldenError(f"golden file {exc}") from None
    except RecursionError:
        raise GoldenError(f"golden file {path} is not readable JSON: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise GoldenError(f"golden file {path} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GoldenError(f"{path} is not an aegis golden fingerprint file")
    if doc.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"golden file {path} has format_version {doc.get('format_version')!r}; this aegis reads {FORMAT_VERSION}")
    try:
        check_seed(doc["seed"])
        _check_records(doc)
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
        raise GoldenError(f"golden file {path} is malformed ({type(exc).__name__}: {exc})") from None
    doc["_path"] = str(path)
    return doc


def _check_records(doc: dict) -> None:
    """Every field a comparison reads, in the form ``record`` writes it: a looser form (upper-case
    or 0x-prefixed hex, a block size that splits 8-byte words) would read as a mismatch later,
    and a mismatch is a FAULTY verdict."""
    block = doc["block"]
    if type(block) is not int or not 8 <= block <= 1 << 30 or block % 8:
        raise ValueError(f"block must be a whole multiple of 8 elements, got {block!r}")
    if not isinstance(doc["records"], list):
        raise TypeError("records must be a list")
    for i, r in enumerate(doc["records"]):
        key, comps = r["key"], r["computations"]
        if not isinstance(key, dict) or not all(isinstance(v, (str, int, type(None))) for v in key.values()):
            raise TypeError(f"records[{i}].key must map names to strings or integers")
        if not isinstance(comps, dict) or not comps:
            raise ValueError(f"records[{i}] holds no computations")
        for name, c in comps.items():
            outs = c["outputs"]
            if not isinstance(outs, dict) or not outs:
                raise ValueError(f"records[{i}].computations.{name} holds no outputs")
            for o, v in outs.items():
                where = f"records[{i}].computations.{name}.outputs.{o}"
                if not (isinstance(v["fingerprint"], str) and _HEX64.fullmatch(v["fingerprint"])):
                    raise ValueError(f"{where}.fingerprint must be 16 lower-case hex digits")
                if not (isinstance(v["blocks"], list) and v["blocks"]
                        and all(isinstance(b, str) and _HEX64.fullmatch(b) for b in v["blocks"])):
                    raise ValueError(f"{where}.blocks must be a list of 16-digit lower-case hex fingerprints")
                if not (isinstance(v["shape"], list) and all(type(d) is int and d >= 0 for d in v["shape"])
                        and isinstance(v["dtype"], str)):
                    raise ValueError(f"{where} needs a shape (list of sizes) and a dtype")


def match(doc: dict, device: Device) -> dict:
    """The record for ``device``'s key; GoldenError naming the differing fields if none, or
    if it does not cover what this aegis computes there (check_record)."""
    key = device_key(device)
    for r in doc["records"]:
        if r["key"] == key:
            check_record(doc, r, device)
            return r
    if not doc["records"]:
        raise GoldenError(f"golden file {doc.get('_path', '')} holds no records")
    closest = min(doc["records"], key=lambda r: sum(r["key"].get(f) != key.get(f) for f in KEY_FIELDS))
    diffs = [f"{f}: recorded {closest['key'].get(f)!r}, this device {key.get(f)!r}" for f in KEY_FIELDS
             if closest["key"].get(f) != key.get(f)]
    raise GoldenError(f"golden file {doc.get('_path', '')} was not recorded for {device.identity.id} ({device.identity.name}); "
                      f"refusing to compare fingerprints across a different stack — {'; '.join(diffs)}. "
                      f"Record a golden on a known-good device of this model and software stack.")


def check_keys(doc: dict, devices: list[Device]) -> None:
    for d in devices:
        match(doc, d)


def check_record(doc: dict, rec: dict, device: Device) -> None:
    """Refuse a record that does not cover what this aegis computes on ``device``: a computation
    missing from it would go unchecked under a HEALTHY verdict, and one it has that this aegis
    does not run cannot be compared."""
    want, have = computations_for(device), list(rec["computations"])
    missing, extra = [n for n in want if n not in have], [n for n in have if n not in want]
    if missing or extra:
        raise GoldenError(f"golden file {doc.get('_path', '')}: the record for {device.identity.id} "
                          + (f"lacks {', '.join(missing)}" if missing else "")
                          + ("; " if missing and extra else "") + (f"has unknown {', '.join(extra)}" if extra else "")
                          + " — record it again with this aegis")

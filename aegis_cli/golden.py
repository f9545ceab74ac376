"""Golden fingerprints: canonical workloads recorded on a known-good GPU (DESIGN §2.3).

A GPU that is wrong the same way every time passes the determinism probe and, alone in its
node, the cross-device probe; only a comparison with a result recorded elsewhere sees it.
``record`` runs the canonical computations (probes/_common.py, those deterministic on the
backend) at a fixed seed and stores each input's and output's fingerprint with its block
fingerprints, keyed by what the bits depend on::

    backend, model (GPU name), driver, cuda (torch's CUDA), torch, kernels (hash of kernels/*.cu)
    (+ threads on the CPU backend, whose float kernels block by thread count)

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
from datetime import datetime, timezone
from pathlib import Path

import torch

from aegis_cli import fingerprint
from aegis_cli.backends.base import Device
from aegis_cli.backends.loader import kernel_hashes
from aegis_cli.config import read_input_text
from aegis_cli.errors import ConfigError, GoldenError
from aegis_cli.probes._common import COMPUTATIONS, assumed_deterministic, sizes_for
from aegis_cli.probes.gemm import check_seed
from aegis_cli.report import atomic_write, tool_version

FORMAT = "aegis-golden"
FORMAT_VERSION = 1
BLOCK = 1 << 16
GOLDEN_SEED = 20240229
KEY_FIELDS = ("backend", "model", "driver", "cuda", "torch", "kernels", "threads")


def device_key(device: Device) -> dict:
    """What a device's canonical fingerprints depend on."""
    ident = device.identity
    kh = hashlib.sha256(json.dumps(kernel_hashes(), sort_keys=True).encode()).hexdigest()[:16]
    key = {"backend": ident.backend, "model": ident.name, "driver": ident.driver, "cuda": torch.version.cuda,
           "torch": torch.__version__, "kernels": kh}
    if ident.backend == "cpu":
        key["threads"] = torch.get_num_threads()
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
        blocks = fingerprint.device_block_fingerprints(t, BLOCK)  # one pass: the whole is their sum
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
        int(doc["block"])
        for r in doc["records"]:
            for c in r["computations"].values():
                for o in c["outputs"].values():
                    int(o["fingerprint"], 16)
                    [int(b, 16) for b in o["blocks"]]
            dict(r["key"])
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
        raise GoldenError(f"golden file {path} is malformed ({type(exc).__name__}: {exc})") from None
    doc["_path"] = str(path)
    return doc


def match(doc: dict, device: Device) -> dict:
    """The record for ``device``'s key; GoldenError naming the differing fields if none."""
    key = device_key(device)
    for r in doc["records"]:
        if r["key"] == key:
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

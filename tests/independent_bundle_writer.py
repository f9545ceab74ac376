"""An independent vTask bundle writer that follows only docs/bundle-format.md.

It uses the standard library and numpy — not aegis, not safetensors — so a test can prove
that the written spec is enough for another program to produce bundles aegis accepts.

    python tests/independent_bundle_writer.py OUT.aegis
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys

import numpy as np


def bf16_bytes(x: np.ndarray) -> bytes:
    """bfloat16 = upper 16 bits of float32 (values here are exact in bf16, so no rounding)."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4") >> 16
    return bits.astype("<u2").tobytes()


def f32_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def write_bundle(path: str) -> None:
    rng = np.random.default_rng(7)
    tensors: list[tuple[str, str, list[int], bytes]] = []  # name, dtype, shape, bytes
    vtasks = []

    # vTask 1: a full dgrad GEMM (A stored M×K, B stored K×N), entries in {-1, 0, 1}:
    # every product and sum is a small integer, exact in fp32 and bf16.
    m, n, k, tile = 12, 20, 16, (8, 8)
    a = rng.integers(-1, 2, (m, k)).astype(np.float32)
    b = rng.integers(-1, 2, (k, n)).astype(np.float32)
    c = a @ b
    pad = (-n) % tile[1]
    row_sums = np.pad(c, ((0, 0), (0, pad))).reshape(m, -1, tile[1]).sum(-1)
    tensors += [("ind0.a", "BF16", [m, k], bf16_bytes(a)), ("ind0.b", "BF16", [k, n], bf16_bytes(b)),
                ("ind0.c", "BF16", [m, n], bf16_bytes(c)), ("ind0.row_sums", "F32", list(row_sums.shape), f32_bytes(row_sums))]
    vtasks.append({
        "id": "independent/dgrad-full/gemm.row_checksum", "kind": "gemm", "check": "gemm.row_checksum", "op": "mlp_down",
        "case_id": "independent/mlp_down/dgrad/ints/12x20x16/s+0+0",
        "gemm": {"layout": "dgrad", "m": m, "n": n, "k": k, "tile": list(tile), "rows": None, "cols": None,
                 "flagged_rows": [3], "flagged_cols": []},
        "tensors": {"a": "ind0.a", "b": "ind0.b", "c": "ind0.c", "row_sums": "ind0.row_sums"},
        "scale": [0, 0], "seed": 7, "dist": "ints",
        "threshold": {"tau": 5e-7, "confirm_margin": 4.0, "normalisation": "abs-product"},
        "observed": {"severity": "SUSPECT", "max_normalised_diff": "inf", "elements": 1, "samples": [{"row": 3, "col_tile": 1}]},
        "provenance": {"host": "elsewhere", "gpu_name": "Imaginary GPU", "gpu_uuid": "GPU-00000000-1111-2222-3333-444444444444",
                       "rank": 5, "step": 1200, "versions": {"writer": "independent"}},
    })

    # vTask 2: a row subset of a fwd GEMM (A stored M×K, B stored as W: N×K): rows 1 and 4 of A.
    m2, n2, k2, rows = 6, 10, 8, [1, 4]
    a_full = rng.integers(-2, 3, (m2, k2)).astype(np.float32)
    w = rng.integers(-2, 3, (n2, k2)).astype(np.float32)
    a_rows = a_full[rows]
    tensors += [("ind1.a", "BF16", [len(rows), k2], bf16_bytes(a_rows)), ("ind1.b", "BF16", [n2, k2], bf16_bytes(w)),
                ("ind1.c", "BF16", [len(rows), n2], bf16_bytes(a_rows @ w.T))]
    vtasks.append({
        "id": "independent/fwd-rows/gemm.row_checksum", "kind": "gemm", "check": "gemm.row_checksum", "op": "qkv",
        "gemm": {"layout": "fwd", "m": m2, "n": n2, "k": k2, "tile": [128, 128], "rows": rows, "flagged_rows": rows},
        "tensors": {"a": "ind1.a", "b": "ind1.b", "c": "ind1.c"},
        "scale": [0, 0], "threshold": {"tau": 5e-7},
    })

    # data section: tensors back to back, offsets relative to its start
    entries, data, pos = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        data += raw
        pos += len(raw)
    manifest = {"format": "aegis-vtask-bundle", "format_version": 1, "created": "2026-01-01T00:00:00+00:00",
                "producer": {"name": "independent_bundle_writer"},
                "tensor_sha256": {name: hashlib.sha256(raw).hexdigest() for name, _, _, raw in tensors},
                "vtasks": vtasks}
    mtext = json.dumps(manifest)
    header = {"__metadata__": {"format": "aegis-vtask-bundle", "format_version": "1", "manifest": mtext,
                               "manifest_sha256": hashlib.sha256(mtext.encode("utf-8")).hexdigest()}, **entries}
    hbytes = json.dumps(header).encode("utf-8")
    hbytes += b" " * ((-len(hbytes)) % 8)  # optional padding
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hbytes)) + hbytes + data)


if __name__ == "__main__":
    write_bundle(sys.argv[1])

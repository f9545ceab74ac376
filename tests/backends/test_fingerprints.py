"""backends/fingerprints.py: fingerprints where a tensor lives agree with the CPU twin in
ops/fingerprint.py, and miscompare records come out the same whichever side fingerprints."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.backends import fingerprints
from aegis_cli.ops import fingerprint


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    e = torch.randn(3, 5000, generator=g).to(torch.bfloat16)
    a = e.clone()
    a.view(-1)[[17, 9000]] = a.view(-1)[[17, 9000]].view(torch.int16).bitwise_xor(0x40).view(torch.bfloat16)
    return e, a


def test_cpu_tensors_get_the_cpu_twins_values():
    e, a = _pair()
    assert fingerprints.device_fingerprint(a) == fingerprint.fingerprint(a) != fingerprint.fingerprint(e)
    assert fingerprints.device_block_fingerprints(a, 1024) == fingerprint.block_fingerprints(a, 1024)
    assert torch.equal(fingerprints.device_block_tensor(a, 1024), fingerprint.block_tensor(a, 1024))


def test_diff_records_match_the_host_comparison():
    e, a = _pair()
    blocks, count, recs = fingerprints.diff_records(e, a, 1024, limit=8)
    assert (blocks, count, recs) == fingerprint.diff_records(e, a, 1024, limit=8)
    assert blocks == [0, 8] and count == 2 and [r["index"] for r in recs] == [17, 9000]
    assert all(r["xor"] == "0x0040" for r in recs)


def test_diff_records_refuse_tensors_that_cannot_be_compared():
    e, _ = _pair()
    with pytest.raises(ValueError, match="cannot compare"):
        fingerprints.diff_records(e, e.float(), 1024)

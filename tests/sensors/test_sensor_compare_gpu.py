"""The sensors' fused comparison (kernels/sensor_compare.cu through backends/cuda_compare.py) against
its torch twin (``sense.sigma_of`` + ``numerics.normalised_diff``, the CPU path) on the same CUDA
tensors (tier 2, ``gpu``): the normalised differences bit for bit, the same largest difference and
finite flag, on special values (NaN, ±Inf, zero σ, the floor), strided sides and real checks of
every layout, flagged or clean."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from aegis_cli.backends.cuda import CudaDevice

    return CudaDevice(0)


def _torch(sides, c):
    from aegis_cli.sensors import sense

    ds = [numerics.normalised_diff(sums, ref, sense.sigma_of(s, rho, cabs, c), floor) for sums, ref, s, rho, cabs, floor in sides]
    finite = all(bool(torch.isfinite(x[2]).all()) for x in sides)
    return ds, [float(d.max()) for d in ds] + [1.0 if finite else 0.0]


def _kernel(sides, c):
    from aegis_cli.backends import cuda_compare

    assert cuda_compare.applies(sides)
    summary = cuda_compare.new_summary(len(sides), torch.device(CUDA))
    assert summary.tolist() == [0.0] * len(sides) + [1.0]
    ds = cuda_compare.compare(sides, c.u, c.p, c.b, c.w, summary)
    return ds, summary.tolist()


def _same(sides, c):
    (dt, st), (dk, sk) = _torch(sides, c), _kernel(sides, c)
    for a, b in zip(dt, dk, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), float((a - b).abs().max())
    assert st == sk, (st, sk)
    return sk


def test_special_values_and_strided_sides_give_the_torch_bits(dev):
    from aegis_cli.sensors import sense

    g = torch.Generator(device=CUDA).manual_seed(11)

    def f64(shape, lo=0.0):
        return torch.rand(shape, generator=g, device=CUDA, dtype=torch.float64) * 1e3 + lo

    c = sense.Sigma(u=3.3e-6, p=1.7e-5, b=2.1e-7, w=3.4e-5)
    r, t = 301, 7
    sums = (torch.randn((r, t), generator=g, device=CUDA) * 100).float()
    ref = sums.double() + torch.randn((r, t), generator=g, device=CUDA, dtype=torch.float64) * 1e-3
    s, rho, cabs = f64((r, t), 1.0), f64((r, t)), f64((r, t))
    ref[0, 0], sums[0, 1], ref[0, 2] = float("nan"), float("inf"), float("-inf")  # → d = inf
    s[1, 0], rho[1, 1], s[1, 2] = 0.0, 0.0, 0.0  # zero σ: divided by 2⁻¹⁰²²
    ref[1, 2] = sums[1, 2].double()  # 0 / 2⁻¹⁰²²
    rho[2, 0], cabs[2, 1], s[2, 2] = float("nan"), float("inf"), float("inf")  # σ NaN or inf
    ref[3, :] = sums[3, :].double()  # exactly equal: 0 after the floor
    for cab in (cabs, None):
        got = _same([(sums, ref, s, rho, cab, 1e-30)], c)
        assert got[0] == float("inf") and got[1] == 0.0  # an infinite s: not finite
    s[2, 2] = 1.0
    assert _same([(sums, ref, s, rho, cabs, 0.0)], c)[1] == 1.0
    # wgrad's shape: σ = s·w, a second side stored transposed (the column references are views)
    rows = (sums[4:], ref[4:], s[4:], None, None, 2e-30)
    n, tm = 513, 5
    col_t = f64((n, tm))
    cols = ((torch.randn((tm, n), generator=g, device=CUDA) * 10).float(), col_t.t(), f64((n, tm), 1.0).t(), None, None, 2e-30)
    assert not cols[1].is_contiguous()
    got = _same([rows, cols], c)
    assert len(got) == 3 and got[-1] == 1.0 and 0 < got[1] < float("inf")


@pytest.mark.parametrize("layout", list(Layout), ids=[x.value for x in Layout])
def test_a_check_through_the_kernel_is_the_torch_path(dev, layout):
    """sense.enqueue on CUDA (the fused kernel) against the torch path on the same sides (the
    device's reference kernel, Σ|c|): bits of every difference, the summary, and, with a sum
    pushed over τ, the same flagged checksums."""
    from aegis_cli.checks import gemm as checks
    from aegis_cli.sensors import sense

    m, n, k = 300, 520, 1000
    g = torch.Generator(device=CUDA).manual_seed(5)
    a = torch.randn(layout.a_stored_shape(m, k), generator=g, device=CUDA).to(torch.bfloat16)
    b = (torch.randn(layout.b_stored_shape(k, n), generator=g, device=CUDA) * 0.02).to(torch.bfloat16)
    ops = GemmOperands(a, b, layout)
    res = sense.launch(dev, ops, None, "train/x")
    noise = dev.noise_model(k)
    c = sense.Sigma.of(noise, k)
    for bump in (False, True):
        if bump:  # a fault's worth in one row sum and (wgrad) one column sum
            res.row_sums[7, 2] += 50.0
            res.col_sums[1, 300] += 50.0
        parts, summary = sense.enqueue(ops, res, noise, True, dev)
        sides = [x[1:] for x in sense._sides(ops, res, True, dev)]
        ds, want = _torch(sides, c)
        assert [p[0] for p in parts] == ["gemm.row_checksum"] + (["gemm.col_checksum"] if layout is Layout.WGRAD else [])
        for (_, d, _, _), w in zip(parts, ds, strict=True):
            assert torch.equal(d, w)
        got = summary.tolist()
        assert got == want and got[-1] == 1.0
        signals, worst, ok = sense.judge_parts(parts, got[:-1], got[-1], 3.5)
        assert ok and (worst > 3.5) is bump and len(signals) == (len(parts) if bump else 0)
        for sig, (name, _, sums, ref), w in zip(signals, parts, ds, strict=False):  # none when clean
            want_sig = checks.checksum_signal(name, w, sums, ref, 3.5)
            assert sig.check == name and torch.equal(sig.where, want_sig.where)

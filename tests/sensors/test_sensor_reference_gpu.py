"""The sensors' reference kernel (kernels/sensor_reference.cu, ``CudaDevice.lean_side``) against its
torch reference (``numerics.lean_side``, fp64) on the same CUDA tensors (tier 2, ``gpu``): random
and ragged shapes, every stored layout of either operand (the kernel's vector and scalar loads),
rows near the ends of the range, NaN/Inf, bit-identical repeats, and the sensors' comparison."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, Layout

pytestmark = pytest.mark.gpu
CUDA = "cuda:0"
# (R, K, N, t): ragged R, K and N, a single row, K below and across one 64-deep stage, many splits
SHAPES = [(77, 517, 300, 128), (3, 5, 7, 64), (1, 2048, 256, 128), (600, 64, 1000, 64), (1030, 4099, 520, 128),
          (256, 8192, 384, 64)]


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from aegis_cli.backends.cuda import CudaDevice

    return CudaDevice(0)


def _bf16(shape, seed: int, transposed: bool, scale: float = 1.0) -> torch.Tensor:
    """A seeded bf16 tensor of ``shape`` (never zeros), stored row-major or as the transpose of a row-major one."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    if transposed:
        return (torch.randn(shape[::-1], generator=g, device=CUDA) * scale).to(torch.bfloat16).t()
    return (torch.randn(shape, generator=g, device=CUDA) * scale).to(torch.bfloat16)


def _compare(got, want) -> tuple[float, float, float]:
    """(worst |Δ sums| ÷ s, worst relative Δ s, worst relative Δ ρ)."""
    (sums, s, rho), (w_sums, w_s, w_rho) = got, want
    assert sums.shape == w_sums.shape and sums.dtype == s.dtype == rho.dtype == torch.float64
    return (float(((sums - w_sums).abs() / w_s).max()), float(((s - w_s).abs() / w_s).max()),
            float(((rho - w_rho).abs() / w_rho).max()))


@pytest.mark.parametrize("left_t", [False, True], ids=["left-rows", "left-cols"])
@pytest.mark.parametrize("right_t", [False, True], ids=["right-rows", "right-cols"])
def test_kernel_matches_the_torch_reference(dev, left_t, right_t):
    """sums within 2⁻⁴⁰ of s (fp64 both, other orders), s and ρ within 10⁻⁵ (fp32 per 64-deep stage);
    the same bits again; without ρ, the same sums."""
    worst = (0.0, 0.0, 0.0)
    for i, (r, k, n, t) in enumerate(SHAPES):
        left = _bf16((r, k), 10 * i, left_t)
        right = _bf16((k, n), 10 * i + 1, right_t, 0.02)
        got = dev.lean_side(left, right, t)
        worst = tuple(map(max, worst, _compare(got, numerics.lean_side(left, right, t))))
        again = dev.lean_side(left, right, t)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), (r, k, n, t)
        sums, s, rho = dev.lean_side(left, right, t, rho=False)  # the build without ρ: the same sums
        assert rho is None and torch.equal(sums, got[0]) and float(((s - got[1]).abs() / got[1]).max()) <= 1e-6
    assert worst[0] <= 2.0**-40, worst
    assert worst[1] <= 1e-5 and worst[2] <= 1e-5, worst


def test_misaligned_operands_take_the_scalar_loads(dev):
    base = _bf16((300, 1031), 3, False)
    left = base[:, 1:1025]  # rows 1031 apart, one element off: no 16-byte vectors
    right = _bf16((1024, 260), 4, True)[:, 1:]
    worst = _compare(dev.lean_side(left, right, 128), numerics.lean_side(left, right, 128))
    assert worst[0] <= 2.0**-40 and worst[1] <= 1e-5 and worst[2] <= 1e-5, worst


def test_extreme_rows_keep_fp64_values_and_nonfinite_rows_stay_nonfinite(dev):
    """Rows scaled by 2¹⁰⁰ (fp32 s and ρ² overflow: the stage is recomputed in fp64) and 2⁻¹⁰⁰ keep
    their s and ρ; NaN and Inf make s non-finite, as in the torch reference (the sensors skip them)."""
    left = _bf16((8, 700), 5, False).float()
    left[0] *= 2.0**100
    left[1] *= 2.0**-100
    left[2, :5] *= 2.0**120
    right = _bf16((700, 256), 6, False)
    left = left.to(torch.bfloat16)
    got, want = dev.lean_side(left, right, 128), numerics.lean_side(left, right, 128)
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    worst = _compare(got, want)
    assert worst[0] <= 2.0**-40 and worst[1] <= 1e-5 and worst[2] <= 1e-5, worst
    left[3, 9] = float("nan")
    left[4, 600] = float("inf")
    got = dev.lean_side(left, right, 128)
    assert not torch.isfinite(got[1][3:5]).any() and torch.isfinite(got[1][5:]).all()


@pytest.mark.parametrize("layout", list(Layout), ids=[x.value for x in Layout])
def test_sensor_comparison_with_the_kernel_is_the_torch_one(dev, layout):
    """sense.enqueue with the device's reference and Σ|c|: the same normalised differences as with
    torch's, within 10⁻⁴ σ, and the same finite flag."""
    from aegis_cli.sensors import sense

    m, n, k = 300, 520, 1000
    a = _bf16(layout.a_stored_shape(m, k), 7, False)
    b = _bf16(layout.b_stored_shape(k, n), 8, False, 0.02)
    ops = GemmOperands(a, b, layout)
    res = sense.launch(dev, ops, None, "train/x")
    noise = dev.noise_model(k)
    parts_t, sum_t = sense.enqueue(ops, res, noise, True)
    parts_k, sum_k = sense.enqueue(ops, res, noise, True, dev)
    assert [p[0] for p in parts_t] == [p[0] for p in parts_k]
    for (_, dt, _, _), (_, dk, _, _) in zip(parts_t, parts_k, strict=True):
        assert float((dt - dk).abs().max()) <= 1e-4
    assert float(sum_t[-1]) == float(sum_k[-1]) == 1.0


def test_tile_abs_sums_match_torch(dev):
    """Σ|c| over column tiles (the sensors' bias term): exact sums of bf16 values, so equal to torch's."""
    for m, n, t in ((300, 1000, 128), (5, 7, 64), (8192 // 16, 2048, 128)):
        x = _bf16((m, n), m + n, False)
        got, want = dev.tile_abs_sums(x, t), numerics.abs_col_tiles(x, t)
        assert got.shape == want.shape and float(((got - want).abs() / want).max()) <= 1e-15

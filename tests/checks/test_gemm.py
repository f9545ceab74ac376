"""The GEMM checks on small hand-built results: a clean run, and one corruption at a time."""

from __future__ import annotations

import math

import torch

from aegis_cli.checks import gemm as checks
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout

TAU = 1e-6
TILE = (4, 4)  # (tm, tn)
M, N, K = 8, 12, 16


def operands(seed: int = 0) -> GemmOperands:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16)
    return GemmOperands(a, b, Layout.DGRAD)


def result(ops: GemmOperands, acc_fault=None, c_fault=None) -> GemmResult:
    """A run as a healthy kernel would return it (fp32 accumulator from the exact product),
    with ``acc_fault(acc)`` applied before the fused sums and ``c_fault(c)`` after the store."""
    acc = (ops.a_mk.double() @ ops.b_kn.double()).float()
    if acc_fault:
        acc_fault(acc)
    c = acc.to(torch.bfloat16)
    if c_fault:
        c_fault(c)
    tm, tn = TILE
    return GemmResult(c=c, row_sums=numerics.sum_col_tiles(acc, tn), col_sums=numerics.sum_row_tiles(acc, tm), tile=TILE)


def by_check(checked: checks.Checked) -> dict[str, checks.Signal]:
    return {s.check: s for s in checked.signals}


def test_clean_run_fires_nothing_and_reports_its_noise():
    ops = operands()
    checked = checks.check_gemm(result(ops), numerics.reference_checksums(ops, TILE), TAU,
                                element_ref=checks.ElementReference.of(ops).at_scale(0))
    assert checked.signals == []
    clean = checked.clean_max()
    assert clean is not None and 0 <= clean < TAU


def test_accumulator_flip_flags_its_row_and_column_and_localises_the_element():
    ops = operands()

    def flip(acc):
        acc[5, 9] += 1000.0

    checked = checks.check_gemm(result(ops, acc_fault=flip), numerics.reference_checksums(ops, TILE), TAU)
    sig = by_check(checked)
    assert set(sig) == {"gemm.row_checksum", "gemm.col_checksum"}  # the store path rounds what it was given
    row, col = sig["gemm.row_checksum"], sig["gemm.col_checksum"]
    assert row.where.tolist() == [[5, 9 // 4]] and row.axes == "row" and row.elements == 1
    assert col.where.tolist() == [[5 // 4, 9]] and col.axes == "col" and col.elements == 1
    assert row.max_value > 1e-3 and float(row.diff[5, 2]) == row.max_value
    assert row.rows == [5] and row.cols == [] and col.rows == [] and col.cols == [9]
    assert row.tiles(*TILE) == col.tiles(*TILE) == [(1, 2)]
    assert row.position(5, 2) == {"row": 5, "col_tile": 2} and col.position(1, 9) == {"row_tile": 1, "col": 9}
    assert checks.localise(row, col, *TILE, limit=16) == [[5, 9]]
    # the clean checksums stay under τ beside the flagged ones
    assert checked.clean_max() < TAU


def test_a_flagged_row_alone_localises_nothing():
    ops = operands()
    res = result(ops)
    res.row_sums[3, 1] += 50.0  # the fused row sum alone is wrong
    sig = by_check(checks.check_gemm(res, numerics.reference_checksums(ops, TILE), TAU))
    assert set(sig) == {"gemm.row_checksum", "gemm.output_rowsum"}  # the output no longer sums to it
    assert sig["gemm.row_checksum"].where.tolist() == [[3, 1]]
    assert checks.localise(sig["gemm.row_checksum"], None, *TILE, limit=16) == []


def test_nonfinite_output_from_finite_inputs():
    ops = operands()
    ref = numerics.reference_checksums(ops, TILE)

    def nan(c):
        c[2, 7] = math.nan

    res = result(ops, c_fault=nan)
    sig = by_check(checks.check_gemm(res, ref, TAU))
    nf = sig["gemm.nonfinite"]
    assert nf.where.tolist() == [[2, 7]] and nf.max_value == 1.0 and nf.axes == "element"
    assert nf.tiles(*TILE) == [(0, 1)] and nf.position(2, 7) == {"row": 2, "col": 7}
    assert set(sig) == {"gemm.nonfinite"}  # a NaN output leaves no rounding bound to break
    ref.row[0, 0] = math.inf  # non-finite inputs: a non-finite C is no fault of the GEMM
    assert checks.nonfinite_signal(res.c, ref) is None


def test_output_store_fault_breaks_the_output_rowsum_bound_only():
    ops = operands()

    def store(c):
        c[6, 10] = c[6, 10] * 64 + 8

    res = result(ops, c_fault=store)
    sig = by_check(checks.check_gemm(res, numerics.reference_checksums(ops, TILE), TAU))
    assert set(sig) == {"gemm.output_rowsum"}  # the fused sums never see a store fault
    s = sig["gemm.output_rowsum"]
    assert s.where.tolist() == [[6, 2]] and s.axes == "row" and s.max_value > 1
    assert s.position(6, 2) == {"row": 6, "col_tile": 2} and s.tile(6, 2, *TILE) == (1, 2)
    assert float(s.bound[6, 2]) > 0


def test_pow2_mismatch_names_the_element_and_its_bits():
    ops = operands()
    res = result(ops)
    expected = res.c.clone()
    expected.view(torch.int16)[1, 3] ^= 0x0004  # one mantissa bit
    sig = by_check(checks.check_gemm(res, numerics.reference_checksums(ops, TILE), TAU, expected=expected))
    s = sig["gemm.pow2_exact"]
    assert s.where.tolist() == [[1, 3]] and s.max_value == 1.0 and s.elements == 1
    assert checks.bf16_bits(s.observed, 1, 3) ^ checks.bf16_bits(s.expected, 1, 3) == 0x0004
    assert checks.pow2_signal(res.c, res.c.clone()) is None


def test_element_reference_flags_an_element_beyond_its_error_bound():
    ops = operands()
    el = checks.ElementReference.of(ops)
    exact, bound = el.at_scale(0)
    assert checks.element_signal(result(ops).c, exact, bound) is None

    def off(c):
        c[4, 0] = c[4, 0] + 0.5 * float(bound[4, 0]) * 100

    s = checks.element_signal(result(ops, c_fault=off).c, exact, bound)
    assert s is not None and s.check == checks.ELEMENT_CHECK
    assert s.where.tolist() == [[4, 0]] and s.max_value > 1
    # at another scale: product and bound scale exactly, the subnormal floor does not
    exact8, bound8 = el.at_scale(8)
    assert torch.equal(exact8, exact * 256) and torch.equal(bound8, (bound - el.floor) * 256 + el.floor)


def test_subgemm_positions_map_to_the_full_gemm():
    s = checks.Signal("gemm.pow2_exact", 1.0, torch.tensor([[0, 1]]), "element")
    rows, cols = [10, 20], [5, 6]
    assert s.position(0, 1, rows.__getitem__, cols.__getitem__) == {"row": 10, "col": 6}
    col = checks.Signal("gemm.col_checksum", 1.0, torch.tensor([[0, 1]]), "col")
    assert col.position(0, 1, rows.__getitem__, cols.__getitem__) == {"row_tile": 0, "col": 6}  # tiles stay


def test_signals_come_in_one_order():
    ops = operands()

    def flip(acc):
        acc[0, 0] += 1000.0

    def store(c):
        c[6, 10] = c[6, 10] * 64 + 8
        c[2, 7] = math.nan

    res = result(ops, acc_fault=flip, c_fault=store)
    expected = res.c.clone()
    expected.view(torch.int16)[7, 11] ^= 1
    el = checks.ElementReference.of(ops).at_scale(0)
    order = [s.check for s in checks.check_gemm(res, numerics.reference_checksums(ops, TILE), TAU, expected=expected,
                                                element_ref=el).signals]
    assert order == ["gemm.row_checksum", "gemm.col_checksum", "gemm.nonfinite", "gemm.output_rowsum",
                     checks.ELEMENT_CHECK, "gemm.pow2_exact"]


def test_element_check_budget_and_depth():
    assert checks.checks_elements(8, 8, 16, budget=1024)
    assert not checks.checks_elements(8, 8, 32, budget=1024)
    assert not checks.checks_elements(1, 1, 1 << 22, budget=1 << 30)  # γ_K has no finite value

"""The GEMM checks: their names, which compare checksums against a threshold and which are
exact expectations."""

from __future__ import annotations

CHECKSUM_CHECKS = ("gemm.row_checksum", "gemm.col_checksum")


GEMM_CHECKS = (*CHECKSUM_CHECKS, "gemm.output_rowsum", "gemm.pow2_exact", "gemm.nonfinite")

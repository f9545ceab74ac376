"""The ground floor: what a computation *is*, with no knowledge of devices.

Data types of each computation (``gemm``: Layout, GemmShape, GemmOperands, GemmResult,
ReferenceChecksums), numerics and thresholds, bitwise fingerprints (the CPU twin of
kernels/fingerprint.cu), verdicts and evidence, case ids and seed rules, workload catalogs,
YAML input, errors, safe file writes, paths and versions. Every other package may import
from here; this package imports from none of them (docs/architecture.md).
"""

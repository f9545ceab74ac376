"""Pure checks: operands or their checksums, results and thresholds in; signals and a
judgement (FAULTY or SUSPECT) out. No device, no I/O. Used alike by the scan probes, by
replay and by training sensors, so a finding means the same wherever it was made."""

"""Seeds: the scan seed's range and the per-case seed every input is drawn from."""

from __future__ import annotations

import zlib

from aegis_cli.ops.errors import ConfigError

MAX_SEED = 0x7FFF_FFFF  # case_seed maps scan seeds 0..MAX_SEED to distinct inputs, no larger ones


def check_seed(seed: object) -> int:
    """A scan seed, refused (ConfigError) outside 0…MAX_SEED: beyond it two seeds would give the
    same inputs under different names, and vTask bundles cannot record a negative one."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer in 0…{MAX_SEED}, got {seed!r}")
    return seed


def case_seed(seed: int, *parts: object) -> int:
    """Stable per-case seed from the scan seed and the case's identity."""
    key = "/".join(str(p) for p in parts).encode()
    return (seed * 0x9E3779B1 + zlib.crc32(key)) & 0x7FFF_FFFF

"""The AegisError family and the exit-code contract.

The library raises these; only the CLI turns them into one ``Error: ...`` line and an
exit code (monitoring-plugin convention, docs/design.md §7.3).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    HEALTHY = 0
    SUSPECT = 1
    FAULTY = 2
    UNKNOWN = 3  # error, bad input, no device, usage error


class AegisError(Exception):
    """Base of every error the library raises on purpose."""

    exit_code = ExitCode.UNKNOWN


class ConfigError(AegisError):
    """A workload catalog, sweep config or option is malformed."""


class InjectSpecError(AegisError):
    """An ``--inject`` spec does not parse."""


class DeviceError(AegisError):
    """A device is unknown, unavailable, or failed while running a check."""


class BundleError(AegisError):
    """A vTask bundle is missing, corrupt, hostile or of an unknown version."""


class GoldenError(AegisError):
    """A golden fingerprint file is missing, corrupt or keyed for other hardware/software."""


class HistoryError(AegisError):
    """The fleet history database is corrupt, locked or of an unknown schema."""


class LockError(AegisError):
    """Another sweep holds the lock."""


class OutputError(AegisError):
    """A report or file cannot be written where asked."""

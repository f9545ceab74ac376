"""The runs of one GEMM case group as the power-of-two vote sees them (docs/design.md §5).

Each run is known by the fingerprint of its C scaled back to the base scale (exact inside
the range the probe admits), so runs at every scale compare bit for bit. Nothing here costs
a clean group anything: a scaled run that matched the base run is taken to have the base
run's bits (the check just compared them), and the base run's own fingerprint is computed
only once something needs it. Re-runs are fingerprinted as they are made, which happens only
after a flag.

Per scale, the first run and the first run with other bits are kept (in host memory, the base
run where it lies) so evidence can show an odd run's bits against the majority's: at most two
results per scale, only once a group has flagged, and only where its evidence can still be
shown in full (``keep``): a device that fails every launch is otherwise counted, not copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from aegis_cli.backends.base import Device
from aegis_cli.checks import vote as voting
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmResult

Key = tuple[int, int]  # (ea, eb): the scale of a case
SAME_AS_BASE = "same as the base run"  # a scaled run's print, until the base run's is needed


@dataclasses.dataclass
class _Scale:
    prints: list  # one per run made: a fingerprint, or SAME_AS_BASE
    kept: list[tuple[object, GemmResult]]  # (print, result) of the first run and of the first with other bits


class GroupRuns:
    """Fingerprints, counts and a few kept results of every run of one case group."""

    def __init__(self, device: Device, keep: bool = True):
        self.device = device
        self.keep = keep  # keep results for evidence (else fingerprints and counts only)
        self.scales: dict[Key, _Scale] = {}
        self.mismatched: list[Key] = []  # scales whose first run broke the pow2 expectation, in run order
        self._base_print: int | None = None
        self._inexact = 0

    def first(self, key: Key, res: GemmResult, mismatched: bool) -> None:
        """The first run of scale ``key``; ``mismatched``: its C broke 2^(a+b)·C of the base run."""
        if key == (0, 0):
            self.scales[key] = _Scale([SAME_AS_BASE], [(SAME_AS_BASE, res)])  # the base run stays where it is
            return
        if not mismatched:
            self.scales[key] = _Scale([SAME_AS_BASE], [])
            return
        p = self._print(key, res)
        self.scales[key] = _Scale([p], [(p, on_host(self.device, res))] if self.keep else [])
        self.mismatched.append(key)

    def recording(self, key: Key, once: Callable) -> Callable:
        """``once`` that also records each run it makes (a confirmation's re-runs) under ``key``."""
        def rerun():
            res, signals = once()
            self.add(key, res)
            return res, signals
        return rerun

    def add(self, key: Key, res: GemmResult) -> None:
        s = self.scales[key]
        p = self._print(key, res)
        s.prints.append(p)
        if self.keep and len(s.kept) < 2 and all(self.resolve(q) != p for q, _ in s.kept):
            s.kept.append((p, on_host(self.device, res)))

    def top_up(self, key: Key, once: Callable[[], GemmResult], runs: int) -> None:
        """Run scale ``key`` again until it has ``runs`` runs in all."""
        while len(self.scales[key].prints) < runs:
            self.add(key, once())

    def prints(self, key: Key) -> list:
        return [self.resolve(p) for p in self.scales[key].prints]

    def resolve(self, p):
        if p is not SAME_AS_BASE:
            return p
        if self._base_print is None:
            self._base_print = self.device.fingerprint(self.scales[(0, 0)].kept[0][1].c)
        return self._base_print

    def vote(self) -> voting.Vote:
        """The vote over every run made so far, scale by scale (in ``scales``' order)."""
        return voting.vote([self.prints(k) for k in self.scales])

    def result(self, print_, prefer: Key) -> tuple[Key, GemmResult] | None:
        """A kept run with these bits and its scale, from scale ``prefer`` where it kept one
        (None if no scale did)."""
        for key in sorted(self.scales, key=lambda k: k != prefer):
            for q, res in self.scales[key].kept:
                if self.resolve(q) == print_:
                    return key, res
        return None

    def _print(self, key: Key, res: GemmResult):
        """The fingerprint of C scaled back to the base scale; a C that does not come back
        exactly (an element corrupted out of the range where scaling is exact) gets bits of
        its own, which no other run shares."""
        e = key[0] + key[1]
        back = numerics.pow2_scale(res.c, -e)
        if e and not torch.equal(numerics.pow2_scale(back, e).view(torch.int16), res.c.view(torch.int16)):
            self._inexact += 1
            return ("not exactly scalable", key, self._inexact)
        return self.device.fingerprint(back)


def on_host(device: Device, res: GemmResult) -> GemmResult:
    """``res`` with its tensors copied to host memory (``device.to_host``), to keep past the run."""
    host = device.to_host
    return dataclasses.replace(res, c=host(res.c), row_sums=host(res.row_sums), col_sums=host(res.col_sums),
                               tile_sm=None if res.tile_sm is None else host(res.tile_sm))

"""Seeds (the scan seed's range, the per-case seed every input is drawn from) and case ids."""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass

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


# -- case ids ------------------------------------------------------------------------------
# A case id names what a probe ran, so that ``aegis scan --case ID`` runs exactly it again:
#   WORKLOAD/OP/LAYOUT/DIST/MxNxK/sEA+EB   a GEMM case at input scale 2^EA·A, 2^EB·B
#   determinism/NAME/SHAPE, pow2/IMPL/MxNxK, golden/NAME, crossdevice/NAME/KEY, memory/passN
# Launch op ids (what a fault's ``op=`` matches) are case ids too, with a probe's own suffix
# (pow2's ``/a+0b+0``, a stored tensor's ``:name``).
_SCALE = re.compile(r"s([+-]\d+)([+-]\d+)")


def scale_token(ea: int, eb: int) -> str:
    """The last part of a GEMM case id at input scale 2^ea·A, 2^eb·B: ``s+0+0``, ``s-16-16``."""
    return f"s{ea:+d}{eb:+d}"


def _as_scale(part: str) -> tuple[int, int] | None:
    """The scale a part spells, written as ``scale_token`` writes it (``s+03+0`` is a plain
    part: read as a scale, it would print back as another id)."""
    m = _SCALE.fullmatch(part)
    if m is None:
        return None
    scale = (int(m[1]), int(m[2]))
    return scale if scale_token(*scale) == part else None


def split_scale(text: str) -> tuple[str, tuple[int, int] | None]:
    """(``text`` without its trailing ``/sEA+EB``, that scale or None), for any id text — a
    launch op id or a bundle's case id from another producer, which need not be a valid CaseId."""
    head, sep, last = text.rpartition("/")
    scale = _as_scale(last) if sep else None
    return (head, scale) if scale is not None else (text, None)


def rescaled(text: str, ea: int, eb: int) -> str:
    """``text`` at input scale (ea, eb): its scale replaced, else the scale appended."""
    return f"{split_scale(text)[0]}/{scale_token(ea, eb)}"


def op_site(op: str) -> str:
    """Where a launch op id acts, whatever its input scale: ``op`` without the scale of its
    case (before any ``:name`` suffix). A permanent fault sits at one place for every scale."""
    head, colon, name = op.partition(":")
    return split_scale(head)[0] + colon + name


@dataclass(frozen=True)
class CaseId:
    """A case id: ``prefix`` (the workload of a GEMM case, else the probe), its parts, and
    the input scale (GEMM cases). ``str`` and ``parse`` are inverses, byte for byte."""

    prefix: str
    parts: tuple[str, ...] = ()
    scale: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.scale is not None:  # Evidence.scale is a list
            object.__setattr__(self, "scale", (int(self.scale[0]), int(self.scale[1])))
        for p in (self.prefix, *self.parts):
            if not p or "/" in p:
                raise ConfigError(f"case id {self._text()!r}: {'an empty part' if not p else f'part {p!r} holds a /'}; "
                                  "ids are names joined by / (e.g. WORKLOAD/OP/LAYOUT/DIST/MxNxK/s+0+0, memory/pass0)")
        if self.parts and _as_scale(self.parts[-1]) is not None:
            raise ConfigError(f"case id {self._text()!r}: its last part reads as a scale; give it as the scale")

    def _text(self) -> str:
        tail = () if self.scale is None else (scale_token(*self.scale),)
        return "/".join((self.prefix, *self.parts, *tail))

    def __str__(self) -> str:
        return self._text()

    @classmethod
    def parse(cls, text: str) -> CaseId:
        """The id ``text`` names (ConfigError for an empty one or one with an empty part)."""
        if not isinstance(text, str) or not text:
            why = "is empty" if text == "" else "is not text"
            raise ConfigError(f"case id {text!r} {why}; ids look like WORKLOAD/OP/LAYOUT/DIST/MxNxK/s+0+0 or PROBE/…")
        head, scale = split_scale(text)
        prefix, *parts = head.split("/")
        return cls(prefix, tuple(parts), scale)

    def with_scale(self, ea: int, eb: int) -> CaseId:
        return dataclasses.replace(self, scale=(ea, eb))

    @property
    def group(self) -> CaseId:
        """The id without its scale: what a case's scale variants share (operands, fault sites)."""
        return dataclasses.replace(self, scale=None)

    def extends(self, other: CaseId) -> bool:
        """Whether this id is ``other`` with more after it (a scale, further parts)."""
        mine = (self.prefix, *self.parts, *(() if self.scale is None else (self.scale,)))
        theirs = (other.prefix, *other.parts)
        return other.scale is None and len(mine) > len(theirs) and mine[:len(theirs)] == theirs

    def part(self, probe: str) -> str | None:
        """The first part after ``probe/`` when this is one of ``probe``'s ids, else None."""
        return self.parts[0] if self.prefix == probe and self.parts else None

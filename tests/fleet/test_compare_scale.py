"""``aegis report`` over a large fleet: the cross-device comparison does work linear in the
devices (up to a log factor for one sort), counted in comparisons, not timed."""

from __future__ import annotations

import math

from aegis_cli.fleet import compare

N = 100_000


class Budget(Exception):
    pass


class CountedNoise(float):
    """A clean_max value that counts every comparison made on it, and stops the comparison
    (raising) once a budget is spent: a quadratic merge fails in seconds, not hours."""

    count = 0
    limit = 0

    def _tick(self):
        CountedNoise.count += 1
        if CountedNoise.count > CountedNoise.limit:
            raise Budget(f"over {CountedNoise.limit} comparisons")

    def __lt__(self, o):
        self._tick()
        return float(self) < o

    def __gt__(self, o):
        self._tick()
        return float(self) > o

    def __le__(self, o):
        self._tick()
        return float(self) <= o

    def __ge__(self, o):
        self._tick()
        return float(self) >= o

    def __eq__(self, o):
        self._tick()
        return float(self) == o

    __hash__ = float.__hash__


def device(i: int, noise: float, fp: str) -> dict:
    return {"device": {"id": "cuda:0", "host": f"node{i:06d}", "uuid": f"GPU-{i:08d}", "name": "H200"},
            "verdict": "HEALTHY", "noise": {"clean_max": CountedNoise(noise)},
            "probes": {compare.PROBE_KEY: {"class": "c1", "fingerprints": {"case-a": fp, "case-b": "b"}}}}


def test_comparing_a_large_fleet_is_linear_in_devices():
    devices = [device(i, 1e-7 * (1 + (i * 7919) % 1000 / 1000), "a") for i in range(N)]
    devices[123] = device(123, 5e-3, "a")  # a noisy device
    devices[456] = device(456, 1e-7, "z")  # an odd one out
    CountedNoise.count, CountedNoise.limit = 0, int(4 * N * math.log2(N))
    result = compare.compare(devices)
    assert CountedNoise.count <= CountedNoise.limit
    assert result["outcome"] == compare.ODD_ONE_OUT
    assert [o["device"] for o in result["odd"]] == ["node000456/cuda:0"]
    assert [o["device"] for o in result["noise_outliers"]] == ["node000123/cuda:0"]
    assert result["groups"][0]["cases"] == 2 and len(result["groups"][0]["devices"]) == N
    applied = compare.apply(devices, result)
    assert [d["device"]["uuid"] for d in applied if d["verdict"] != "HEALTHY"] == ["GPU-00000123", "GPU-00000456"]


def test_class_median_leaves_out_the_device_itself():
    devices = [device(i, v, "a") for i, v in enumerate([1.0, 2.0, 3.0, 100.0, float("inf"), 0.0])]
    CountedNoise.count, CountedNoise.limit = 0, 10_000
    out = compare.compare(devices)["noise_outliers"]
    # 100 against the median of 1, 2, 3 (inf is no measurement, 0 not a positive one)
    assert out == [{"device": "node000003/cuda:0", "clean_max": 100.0, "class_median": 2.0}]

import pytest

from pipeline.policy.bands import BandScheduler

SHARES = (0.0, 0.10, 0.05, 0.05, 0.05)


def _serve(s: BandScheduler, has_work, n: int) -> list[int]:
    served = []
    for _ in range(n):
        band = s.pick(has_work)
        s.record(band)
        served.append(band)
    return served


def test_the_highest_band_with_work_goes_first():
    s = BandScheduler(SHARES)
    assert s.pick([False, False, True, False, True]) == 2
    assert s.pick([True, True, True, True, True]) == 0
    assert s.pick([False] * 5) is None


def test_lower_bands_keep_their_minimum_share_under_sustained_high_band_load():
    s = BandScheduler(SHARES, window=200)
    served = _serve(s, [True] * 5, 2000)[200:]
    for band, minimum in enumerate(SHARES):
        share = served.count(band) / len(served)
        assert share >= minimum * 0.95, (band, share)
    assert served.count(0) / len(served) >= 0.7  # the rest goes to the top band


def test_without_contention_a_band_gets_everything():
    s = BandScheduler(SHARES)
    assert set(_serve(s, [False, False, False, False, True], 100)) == {4}


def test_invalid_shares_are_refused():
    with pytest.raises(ValueError):
        BandScheduler((0.5, 0.5, 0.1, 0, 0))

"""Admission settings: defaults, conversion from the top-level config, validation."""

import pytest

from velocity_fast.admission.errors import AdmissionConfigError
from velocity_fast.admission.settings import AdmissionSettings, BandSettings


def test_defaults_are_the_design_bands():
    s = AdmissionSettings().validate()
    assert [(b.name, b.ceiling) for b in s.bands] == [("high", 1.5), ("normal", 1.0), ("low", 0.8)]
    # Batch work has no deadline by default; the others take the server's.
    assert [b.sla_ms for b in s.bands] == [None, None, 0.0]
    assert (s.queue_threshold, s.kv_threshold, s.default_band) == (5.0, 0.8, "normal")


def test_rising_ceiling_is_rejected_naming_the_band():
    bands = [BandSettings(name="gold", ceiling=1.0), BandSettings(name="bronze", ceiling=1.2)]
    with pytest.raises(AdmissionConfigError, match=r"bands\[1\].ceiling: band 'bronze'.*'gold'.*must not rise"):
        AdmissionSettings(bands=bands).validate()


def test_from_top_level_settings_and_admission_mapping():
    from velocity_fast.config import BandConfig, Settings

    top = Settings(
        sla_ms=1500,
        max_concurrency=12,
        bands=[BandConfig(name="a", ceiling=2.0), BandConfig(name="b", ceiling=0.5, ttl_ms=100)],
        admission={"fairness": "tokens", "aging_step_ms": 250},
    )
    s = AdmissionSettings.from_settings(top)
    assert (s.sla_ms, s.aimd_max, s.fairness, s.aging_step_ms) == (1500, 12, "tokens", 250)
    assert [b.name for b in s.bands] == ["a", "b"] and s.bands[1].ttl_ms == 100
    assert s.default_band == "b"  # no "normal": the middle band


def test_from_settings_rejects_rising_ceilings_and_unknown_keys():
    from velocity_fast.config import BandConfig, Settings

    top = Settings(bands=[BandConfig(name="hi", ceiling=0.5), BandConfig(name="lo", ceiling=0.9)])
    with pytest.raises(AdmissionConfigError, match="'lo'"):
        AdmissionSettings.from_settings(top)
    with pytest.raises(AdmissionConfigError, match="bogus"):
        AdmissionSettings.from_settings(Settings(admission={"bogus": 1}))


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"fairness": "lottery"}, "fairness"),
        ({"aimd_min": 5, "aimd_max": 2}, "aimd_min"),
        ({"queue_threshold": 0}, "queue_threshold"),
        ({"bands": []}, "bands"),
        ({"bands": [BandSettings(name="x", ceiling=1), BandSettings(name="x", ceiling=1)]}, "duplicate"),
        ({"ewma_alpha": 0}, "ewma_alpha"),
    ],
)
def test_bad_values_name_the_key(kw, key):
    with pytest.raises(AdmissionConfigError, match=key):
        AdmissionSettings(**kw).validate()

"""AIMD concurrency limit: +1, x0.75 once per window, OOM to minimum with a freeze."""

import pytest

from velocity_fast.admission.aimd import AimdLimit


def test_increase_only_when_limit_holds_work_back():
    a = AimdLimit(2, 10, initial=4)
    assert not a.on_sample(False, True, True, 0.0)
    assert not a.on_sample(True, False, True, 0.0)
    assert not a.on_sample(True, True, False, 0.0)
    assert a.on_sample(True, True, True, 0.0)
    assert a.limit == 5
    for _ in range(20):
        a.on_sample(True, True, True, 0.0)
    assert a.limit == 10


def test_breach_cuts_by_a_quarter_once_per_window():
    a = AimdLimit(2, 64, initial=32)
    assert a.on_breach(0.0, 1.0)
    assert a.limit == 24
    # Same window: requests that started before the cut do not cut again.
    assert not a.on_breach(0.5, 1.1)
    assert a.on_breach(1.2, 2.0)
    assert a.limit == 18
    for t in range(3, 40):
        a.on_breach(float(t), float(t) + 0.5)
    assert a.limit == 2


def test_oom_drops_to_minimum_and_freezes_then_recovers():
    a = AimdLimit(1, 32, cooldown=5.0)
    a.on_oom(10.0)
    assert a.limit == 1 and a.frozen(12.0)
    assert not a.on_sample(True, True, True, 12.0)
    assert not a.frozen(15.1)
    assert a.on_sample(True, True, True, 15.1)
    assert a.limit == 2 and a.ooms == 1


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        AimdLimit(0, 4)
    with pytest.raises(ValueError):
        AimdLimit(5, 4)
    assert AimdLimit(2, 8, initial=100).limit == 8
    assert AimdLimit(2, 8).limit == 8


def test_slow_start_grows_by_half_per_probe_until_the_first_decrease():
    a = AimdLimit(1, 32, 8, 10.0)
    seen = [a.limit]
    while a.on_probe(0.0):
        seen.append(a.limit)
    assert seen == [8, 12, 18, 27, 32]
    b = AimdLimit(1, 32, 8, 10.0)
    assert b.on_probe(0.0) and b.limit == 12
    assert b.on_breach(0.0, 1.0) and b.limit == 9
    assert not b.on_probe(2.0) and b.limit == 9  # a decrease ends the slow start
    tiny = AimdLimit(1, 32, 1, 10.0)
    assert tiny.on_probe(0.0) and tiny.limit == 2  # at least one more


def test_an_idle_engine_gets_its_starting_limit_and_a_new_slow_start():
    a = AimdLimit(1, 32, 8, 10.0)
    for t in range(1, 9):
        a.on_breach(float(t), float(t) + 0.5)
    assert a.limit == 1 and not a.on_probe(10.0)
    assert a.on_idle(20.0) and a.limit == 8  # as a fresh limit
    assert a.on_probe(20.1) and a.limit == 12  # slow start again
    b = AimdLimit(1, 32, 8, 10.0)
    assert b.on_probe(0.0) and b.on_probe(0.0) and b.on_breach(0.0, 1.0) and b.limit == 13
    assert not b.on_idle(5.0) and b.limit == 13  # above the start: kept
    assert b.on_probe(5.1) and b.limit == 20  # but probing again
    c = AimdLimit(1, 32, 8, 10.0)
    c.on_oom(0.0)
    assert not c.on_idle(5.0) and c.limit == 1  # not during the out-of-memory cool-down
    assert c.on_idle(10.5) and c.limit == 8

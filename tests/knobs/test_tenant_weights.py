"""A tenant's `weight` is its share in fairness, in both fairness modes of the band queues:
of two backlogged tenants, the one of weight 2 is served twice as often (by turns) or
twice the tokens (virtual token counter); with every weight 1 nothing changes."""

import math

import pytest

from velocity_fast.admission.bands import BandQueues
from velocity_fast.admission.policies import make_policy
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.config import ConfigError, load_settings

INF = math.inf


def _backlog(q, tenants, n, tokens=lambda t, i: 10.0):
    for i in range(n):
        for t in tenants:
            assert q.enqueue((t, i), t, 0, 0, tokens(t, i), INF, 0.0) > 0


def _served(q, n):
    return [q.pop(0, 0.0).tenant for _ in range(n)]


@pytest.mark.parametrize("token_fair", [False, True], ids=["rr", "tokens"])
@pytest.mark.parametrize("edf", [False, True], ids=["fifo", "edf"])
def test_weight_two_gets_twice_the_turns_of_weight_one(token_fair, edf):
    q = BandQueues([(0, 0, 0.0)], token_fair=token_fair, edf=edf, weights={"heavy": 2.0, "light": 1.0})
    _backlog(q, ["heavy", "light"], 200)
    served = _served(q, 300)
    ratio = served.count("heavy") / served.count("light")
    assert 1.8 <= ratio <= 2.2, ratio
    # Interleaved, not in blocks: every window of 6 pops holds both tenants.
    assert all({"heavy", "light"} <= set(served[i : i + 6]) for i in range(0, 294))


def test_round_robin_weight_two_is_two_requests_per_visit():
    q = BandQueues([(0, 0, 0.0)], weights={"a": 2.0})
    _backlog(q, ["a", "b"], 10)
    assert _served(q, 9) == ["a", "a", "b", "a", "a", "b", "a", "a", "b"]


def test_round_robin_fractional_weights_carry_over_between_visits():
    q = BandQueues([(0, 0, 0.0)], weights={"half": 0.5, "x": 1.5})
    _backlog(q, ["half", "x", "one"], 400)
    served = _served(q, 600)
    # Shares 0.5 : 1.5 : 1 of 3 turns per rotation.
    assert served.count("half") == pytest.approx(100, abs=3)
    assert served.count("x") == pytest.approx(300, abs=3)
    assert served.count("one") == pytest.approx(200, abs=3)


def test_a_tiny_weight_is_one_turn_per_visit_and_the_others_scale_up():
    # Weights 0.001 : 1 are quanta 1 : 1000, so no visit passes without a turn (a tenant
    # of weight 0.001 does not wait a thousand rotations of the ring to be served once).
    q = BandQueues([(0, 0, 0.0)], weights={"tiny": 0.001, "other": 0.001})
    assert q.weights == {"tiny": 0.001, "other": 0.001}
    _backlog(q, ["tiny", "other", "big"], 2100)
    served = _served(q, 2004)
    assert served[:2] == ["tiny", "other"] and served[2:1002] == ["big"] * 1000
    assert (served.count("tiny"), served.count("other"), served.count("big")) == (2, 2, 2000)
    assert q.tenant_queue(0, "tiny").weight == 0.001  # the weight itself stays as configured


def test_token_fairness_weighs_tokens_not_turns():
    # heavy asks 100 tokens a request, light 50: by tokens at weights 2:1, heavy gets twice
    # the tokens, so the same number of requests as light.
    q = BandQueues([(0, 0, 0.0)], token_fair=True, weights={"heavy": 2.0})
    _backlog(q, ["heavy", "light"], 300, tokens=lambda t, i: 100.0 if t == "heavy" else 50.0)
    served = _served(q, 300)
    tokens = {
        t: 100.0 * served.count("heavy") if t == "heavy" else 50.0 * served.count("light") for t in ("heavy", "light")
    }
    assert 1.8 <= tokens["heavy"] / tokens["light"] <= 2.2
    # Without weights the same backlog is served at 1:1 in tokens (light gets twice the requests).
    q = BandQueues([(0, 0, 0.0)], token_fair=True)
    _backlog(q, ["heavy", "light"], 300, tokens=lambda t, i: 100.0 if t == "heavy" else 50.0)
    served = _served(q, 300)
    assert 1.8 <= served.count("light") / served.count("heavy") <= 2.2


@pytest.mark.parametrize("token_fair", [False, True], ids=["rr", "tokens"])
def test_all_weights_one_serve_in_the_same_order_as_no_weights(token_fair):
    def run(weights):
        q = BandQueues([(0, 0, 0.0), (0, 0, 0.0)], token_fair=token_fair, weights=weights)
        order = []
        # Tenants come and go; some items are cancelled mid-way.
        for step in range(60):
            t = "abc"[step % 3] if step % 7 else "d"
            q.enqueue((t, step), t, step % 2, 0, float(5 + step % 11), INF, 0.0)
            if step % 5 == 4:
                it = q.pop(step % 2, 0.0)
                order.append(it.waiter if it else None)
            if step % 13 == 12:
                q.cancel(step - 1)
        for band in (0, 1):
            while (it := q.pop(band, 0.0)) is not None:
                order.append(it.waiter)
        return order

    plain = run(None)
    assert run({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}) == plain
    assert len(plain) > 50


def test_an_emptied_tenant_keeps_no_turns_for_later():
    q = BandQueues([(0, 0, 0.0)], weights={"a": 3.0})
    q.enqueue("a0", "a", 0, 0, 1, INF, 0.0)
    q.enqueue("b0", "b", 0, 0, 1, INF, 0.0)
    assert q.pop(0, 0.0).waiter == "a0"  # a's visit had 3 turns; it used one and emptied
    assert q.pop(0, 0.0).waiter == "b0"
    _backlog(q, ["a", "b"], 10)
    # Back with work, a starts a fresh visit of 3, not 2 banked plus 3.
    assert [w[0] for w in (q.pop(0, 0.0).waiter for _ in range(8))] == list("aaabaaab")


def test_the_weight_is_kept_on_the_tenants_queue():
    q = BandQueues([(0, 0, 0.0), (0, 0, 0.0)], weights={"a": 2.5, "b": 1.0})
    assert q.weights == {"a": 2.5}  # weight 1 is the default, not stored
    assert q.weight_of("a") == 2.5 and q.weight_of("b") == 1.0 and q.weight_of("zz") == 1.0
    q.enqueue(1, "a", 1, 0, 1, INF, 0.0)
    q.enqueue(2, "zz", 1, 0, 1, INF, 0.0)
    assert q.tenant_queue(1, "a").weight == 2.5
    assert q.tenant_queue(1, "zz").weight == 1.0
    assert q.tenant_queue(0, "a") is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_weight_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="weight of tenant 'a'"):
        BandQueues([(0, 0, 0.0)], weights={"a": bad})


def test_config_refuses_a_non_positive_weight_naming_the_key():
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.weight"):
        load_settings(flags={"tenants": [{"name": "a"}, {"name": "b", "weight": 0}]}, env={})


def test_the_policy_hands_the_tenants_weights_to_the_queues():
    for name in ("static", "dynamic", "smart"):
        pol = make_policy(name, AdmissionSettings(), {"a": 2.0, "b": 0.5})
        q = pol.make_queues(AdmissionSettings())
        assert q.weights == {"a": 2.0, "b": 0.5}


def test_admission_built_from_settings_reads_the_tenants_weights():
    from velocity_fast.admission.controller import Admission

    s = load_settings(
        flags={"tenants": [{"name": "a", "weight": 2.0}, {"name": "b"}], "admission": {"fairness": "tokens"}}, env={}
    )
    adm = Admission(s, {})
    try:
        assert adm.policy.weights == {"a": 2.0, "b": 1.0}
        assert adm.policy.make_queues(adm.settings).weights == {"a": 2.0}
    finally:
        adm.close()

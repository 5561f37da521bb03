"""The output tokens of a request that names no max tokens: a documented starting value,
then what the pool's engines returned for such requests (admission/estimators.pyx)."""
import pytest

from tests.admission.test_admission import make
from velocity_fast.admission.estimators import OPEN_ALPHA, OPEN_START_CHAT, OPEN_START_TEXT, OutputEstimate


def test_the_start_stands_until_the_first_answer_then_the_answers_mean():
    e = OutputEstimate(128)
    assert e.expect() == 128 and e.answers == 0
    e.observe(39)
    assert e.expect() == 39  # the first answer replaces the guess whole
    e.observe(0)             # no usage read: nothing learned
    e.observe(-3)
    assert e.answers == 1
    e.observe(41)
    assert e.expect() == 40 and e.answers == 2
    assert e.snapshot() == {"tokens": 40, "answers": 2, "start": 128}


def test_after_the_first_answers_it_follows_a_change_of_workload():
    e = OutputEstimate(OPEN_START_CHAT)
    for _ in range(int(1 / OPEN_ALPHA)):
        e.observe(400)
    assert e.expect() == 400
    for _ in range(60):
        e.observe(20)
    assert 20 <= e.expect() < 40  # the long replies of an hour ago no longer count
    assert OutputEstimate(0.2).expect() == 1  # never less than a token


def test_each_pool_learns_its_own_chat_and_completions_estimates():
    adm, _ = make()
    chat, text = adm.open_estimate("m", True), adm.open_estimate("m", False)
    assert chat is not text and adm.open_estimate(None, True) is chat  # None: the default pool
    assert (chat.expect(), text.expect()) == (OPEN_START_CHAT, OPEN_START_TEXT)
    assert OPEN_START_TEXT == 16  # vLLM's own default max_tokens for /v1/completions
    chat.observe(57)
    assert adm.open_estimate("m", True).expect() == 57 and text.expect() == OPEN_START_TEXT
    assert adm.open_estimate("other", True) is None
    assert adm.stats()["pools"]["m"]["open_tokens"] == {
        "chat": {"tokens": 57, "answers": 1, "start": OPEN_START_CHAT},
        "completions": {"tokens": OPEN_START_TEXT, "answers": 0, "start": OPEN_START_TEXT}}
    adm.close()

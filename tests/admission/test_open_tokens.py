"""The output tokens of a request that names no max tokens: a documented starting value,
then what the pool's engines returned for such requests (admission/estimators.pyx)."""

from tests.admission.test_admission import make
from velocity_fast.admission.estimators import OPEN_START_CHAT, OPEN_START_TEXT, OPEN_WINDOW, OutputEstimate


def test_the_start_stands_until_the_first_answer_then_the_answers_mean():
    e = OutputEstimate(128)
    assert e.expect() == 128 and e.answers == 0
    e.observe(39)
    assert e.expect() == 39  # the first answer replaces the guess whole
    e.observe(0)  # no usage read: nothing learned
    e.observe(-3)
    assert e.answers == 1
    e.observe(41)
    assert e.expect() == 40 and e.answers == 2
    assert e.snapshot() == {"tokens": 40, "answers": 2, "start": 128}


def test_it_is_the_mean_of_the_last_answers_whatever_order_they_end_in():
    burst = [10 * (i % 8 + 1) for i in range(OPEN_WINDOW)]  # mean 45
    ends_short_first, ends_long_first = OutputEstimate(OPEN_START_CHAT), OutputEstimate(OPEN_START_CHAT)
    for n in sorted(burst):  # a burst's longest replies end last
        ends_short_first.observe(n)
    for n in sorted(burst, reverse=True):
        ends_long_first.observe(n)
    assert ends_short_first.expect() == ends_long_first.expect() == 45
    for _ in range(OPEN_WINDOW):  # then the workload changes: the old replies no longer count
        ends_short_first.observe(400)
    assert ends_short_first.expect() == 400 and ends_short_first.answers == 2 * OPEN_WINDOW
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
        "completions": {"tokens": OPEN_START_TEXT, "answers": 0, "start": OPEN_START_TEXT},
    }
    adm.close()

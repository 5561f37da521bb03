"""Precise prefix routing's decision (routing/precise/scoring.py): an endpoint whose KV-event index
is exact is scored by what its engine holds; the approximate index stands in when the
index is not exact or the request's tokens are not ready."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.support.fleet import make_pool
from velocity_fast.kvevents.index import EXACT, BlockIndex, chain_hashes
from velocity_fast.kvevents.wire import Cleared, Stored
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.precise.scoring import PrecisePrefix
from velocity_fast.routing.precise.template import chat_template
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings

BS = 4
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
    "tau upsilon phi chi psi omega system user assistant you are a helpful bot"
).split()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"])
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def chat(*turns):
    roles = ["system"] + ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns)]}


def messages_ids(tok_path, body):
    tok = Tokenizer.from_file(tok_path)
    msgs = [(m["role"], m["content"]) for m in body["messages"]]
    return tok.encode(chat_template(msgs), add_special_tokens=False).ids


def engine_holds(index: BlockIndex, key: str, ids: list[int]) -> None:
    """The engine of ``key`` cached the full blocks of ``ids`` (as its KV events say)."""
    n = len(ids) // BS
    index.set_state(key, EXACT)
    index.apply(key, [Stored([f"{key}-{i}" for i in range(n)], None, ids[: n * BS], BS, None, "GPU", None, None)])


def wait_ready(info, timeout=5.0):
    end = time.monotonic() + timeout
    while info.precise.chain is None and time.monotonic() < end:
        time.sleep(0.005)
    assert info.precise.chain is not None, "the tokenizer thread never finished"


@pytest.fixture
def setup(tokenizer_json):
    made = []

    def build(**kw):
        kw.setdefault("seed", 3)
        kw.setdefault("default_profile", "chat")
        s = RoutingSettings(prefix="precise", tokenizer=tokenizer_json, **kw)
        index = BlockIndex()
        reg = Registry()
        precise = PrecisePrefix(s, index, registry=reg, block_size=lambda model: BS)
        made.append(precise)
        return Router(s, registry=reg, precise=precise), index, precise, reg

    yield build
    for p in made:
        p.close()


SYSTEM = " ".join(WORDS[:20])


def test_exact_index_beats_the_approximate_one_when_they_disagree(setup, tokenizer_json):
    r, index, _, reg = setup()
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "alpha beta gamma")
    # This gateway last sent the prompt to e0 (the approximate index says e0) ...
    info0 = r.route_info("m", body, {})
    r.on_dispatch(e0, info0)
    # ... but e1's engine is the one that holds it (it restarted e0, or another gateway sent it).
    engine_holds(index, "e0", [])
    engine_holds(index, "e1", messages_ids(tokenizer_json, body))
    info = r.route_info("m", body, {})
    wait_ready(info)
    picks = {r.pick(pool, info).name for _ in range(20)}
    assert picks == {"e1"}
    text = reg.render().decode()
    assert 'velocity_prefix_precise_picks_total{model="m",how="precise"} 20' in text
    # The same request in an approximate gateway goes to e0: the two indexes disagree.
    plain = Router(RoutingSettings(seed=3, default_profile="chat"), registry=Registry())
    plain.on_dispatch(e0, plain.route_info("m", body, {}))
    assert {plain.pick(pool, plain.route_info("m", body, {})).name for _ in range(20)} == {"e0"}


def test_an_endpoint_not_exact_is_scored_by_the_approximate_index(setup, tokenizer_json):
    r, index, _, _ = setup()
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "delta epsilon")
    r.on_dispatch(e0, r.route_info("m", body, {}))
    # e1 holds a little of the prompt for sure; e0's index is approximate (events lost),
    # so its score is the approximate index's: the whole prompt.
    ids = messages_ids(tokenizer_json, body)
    engine_holds(index, "e1", ids[:BS])
    index.stats("e0").state = "approximate"
    info = r.route_info("m", body, {})
    wait_ready(info)
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}
    # Once e0 is exact and holds nothing, e1's block wins.
    engine_holds(index, "e0", [])
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}


def test_a_prefix_no_engine_holds_goes_to_the_emptiest_cache_among_the_least_loaded(setup, tokenizer_json):
    """After a restart the restarted engine's cache is empty: a prompt cold everywhere
    goes there (it evicts nothing), not onto a full cache at random; load still comes first."""
    r, index, _, _ = setup()
    pool = make_pool(3)
    e0, e1, e2 = pool.endpoints
    engine_holds(index, "e0", messages_ids(tokenizer_json, chat(SYSTEM, "alpha beta gamma")))
    engine_holds(index, "e1", [])  # restarted: exact and empty
    index.stats("e2").state = "approximate"  # unknown: counts as full
    cold = chat("omega psi chi phi upsilon tau sigma rho pi omicron xi nu mu", "kappa iota")
    info = r.route_info("m", cold, {})
    wait_ready(info)
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}
    assert r.stats()["picks"]["chat"]["kv"] == 20
    # The emptiest engine is busier than the others: the least loaded of them takes it.
    e1.inflight = 2
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}
    # A prompt that one engine holds still goes by affinity, not to the empty cache.
    e1.inflight = 0
    warm = r.route_info("m", chat(SYSTEM, "alpha beta gamma"), {})
    wait_ready(warm)
    assert {r.pick(pool, warm).name for _ in range(20)} == {"e0"}


def test_prefixes_no_engine_holds_spread_over_full_caches_that_differ_by_a_few_blocks(setup, tokenizer_json):
    """Full caches hold a few blocks more or less from one event to the next; a cold
    prefix evicts as much on each, so the equals are drawn at random, not all sent to the
    one that happens to hold two blocks fewer. An engine with room stays the choice."""
    r, index, _, _ = setup()
    pool = make_pool(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    for k, ep in enumerate(pool.endpoints):
        ids = messages_ids(tokenizer_json, chat(SYSTEM, " ".join(words[k:] + words[:k]) * 3))
        engine_holds(index, ep.name, ids[: len(ids) - k * BS])  # 0, 1 and 2 blocks fewer
    cap = index.size("e0")
    for ep in pool.endpoints:
        ep.num_gpu_blocks = cap
    cold = chat("omega psi chi phi upsilon tau sigma rho pi omicron xi nu mu", "kappa iota")
    info = r.route_info("m", cold, {})
    wait_ready(info)
    assert {r.pick(pool, info).name for _ in range(60)} == {"e0", "e1", "e2"}
    pool.endpoints[1].num_gpu_blocks = cap * 4  # room for it: no eviction
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}


@pytest.mark.parametrize("weight, expect", [(1.0, "e1"), (0.0, "e0")])
def test_a_full_cache_holding_part_of_a_prompt_yields_it_to_an_emptied_engine(setup, tokenizer_json, weight, expect):
    """e0's cache is full and holds the first half of the prompt (the rest evicted); e1
    restarted and is empty. With free_cache_weight (default 1) e1 takes the prompt: a
    cold prefill there evicts nothing, where on e0 the other half would push out another
    tenant's blocks. With 0 the half match decides."""
    r, index, _, _ = setup(free_cache_weight=weight)
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "alpha beta gamma delta epsilon zeta eta theta")
    ids = messages_ids(tokenizer_json, body)
    half = ids[: (len(ids) // BS // 2) * BS]
    engine_holds(index, "e0", half)
    engine_holds(index, "e1", [])
    e0.num_gpu_blocks = index.size("e0")  # full
    e1.num_gpu_blocks = index.size("e0")
    info = r.route_info("m", body, {})
    wait_ready(info)
    assert {r.pick(pool, info).name for _ in range(20)} == {expect}
    if weight:
        # A prompt the full engine holds whole stays there while the emptied one is busier.
        engine_holds(index, "e0", ids)
        e0.num_gpu_blocks = index.size("e0")
        e1.inflight = 2
        assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}


def test_a_prompt_sent_counts_as_on_its_way_until_its_engine_reports_it(setup, tokenizer_json):
    """A prompt's blocks appear in its engine's events only after the prefill. Until then
    the router counts them as on their way there: the same prefix follows the first
    request instead of being placed again at random (three empty engines tie), and the
    engine's cache counts them, so another cold prompt goes where it evicts nothing."""
    r, index, precise, _ = setup()
    pool = make_pool(3)
    for ep in pool.endpoints:
        engine_holds(index, ep.name, [])
    first = chat(SYSTEM, "alpha beta gamma delta epsilon")
    info = r.route_info("m", first, {})
    wait_ready(info)
    n = len(info.precise.chain)
    for ep in pool.endpoints:
        ep.num_gpu_blocks = n + 1  # room for one such prompt each, and a block
    # Not sent: picks alone change nothing, the three engines stay equal.
    assert len({r.pick(pool, info).name for _ in range(30)}) > 1
    assert precise.stats()["on_way"] == {}
    to = r.pick(pool, info)
    r.on_dispatch(to, info)
    assert precise.stats()["on_way"] == {to.name: n}
    # The same prompt and its next turn follow it.
    assert {r.pick(pool, info).name for _ in range(20)} == {to.name}
    nxt = r.route_info("m", chat(SYSTEM, "alpha beta gamma delta epsilon", "zeta eta", "theta iota"), {})
    wait_ready(nxt)
    assert {r.pick(pool, nxt).name for _ in range(20)} == {to.name}
    # Another cold prompt avoids the engine whose room the first one takes.
    other = r.route_info("m", chat("omega psi chi phi upsilon tau sigma rho", "pi omicron xi"), {})
    wait_ready(other)
    picks = {r.pick(pool, other).name for _ in range(30)}
    assert to.name not in picks and len(picks) == 2
    # Once the engine's events report the blocks they are held, no longer on their way.
    engine_holds(index, to.name, messages_ids(tokenizer_json, first))
    assert r.pick(pool, info).name == to.name
    assert precise.stats()["on_way"] == {}
    # An endpoint the router forgets (it left, or restarted) keeps nothing on its way.
    r.on_dispatch(to, nxt)
    assert to.name in precise.stats()["on_way"]
    r.forget(to.name)
    assert precise.stats()["on_way"] == {} and to.name not in precise._placed


def test_a_prompt_its_engine_stored_and_then_dropped_is_no_longer_on_its_way(setup, tokenizer_json):
    """The engine's events store a prompt sent to it and then drop it (its cache reset,
    or evicted) before the router next scores that engine: the events' word stands, the
    prompt is not counted as still on its way there, and the engine that holds it now wins."""
    r, index, precise, _ = setup()
    pool = make_pool(2)
    for ep in pool.endpoints:
        engine_holds(index, ep.name, [])
    body = chat(SYSTEM, "alpha beta gamma delta epsilon")
    info = r.route_info("m", body, {})
    wait_ready(info)
    to = r.pick(pool, info)
    other = next(ep for ep in pool.endpoints if ep is not to)
    r.on_dispatch(to, info)
    assert precise.stats()["on_way"] == {to.name: len(info.precise.chain)}
    engine_holds(index, to.name, messages_ids(tokenizer_json, body))  # its prefill stored it
    index.apply(to.name, [Cleared()])  # and its cache was emptied
    engine_holds(index, other.name, messages_ids(tokenizer_json, body))  # the prompt came to the other
    assert {r.pick(pool, info).name for _ in range(10)} == {other.name}
    assert precise.stats()["on_way"] == {}
    assert index._watch.get(to.name) == {}  # nothing left watched


def engine_also_holds(index: BlockIndex, key: str, ids: list[int], tag: str) -> None:
    """More blocks in the engine's cache (another tenant's), beside what it holds."""
    n = len(ids) // BS
    index.apply(key, [Stored([f"{key}-{tag}-{i}" for i in range(n)], None, ids[: n * BS], BS, None, "GPU", None, None)])


@pytest.mark.parametrize("kept, expect", [(0.7, "e1"), (0.95, "e0")])
def test_a_full_cache_that_would_evict_for_the_rest_of_a_prompt_yields_it_to_one_with_room(
    setup, tokenizer_json, kept, expect
):
    """e0's cache is full and kept part of the prompt; e1 is a third full of another
    tenant's blocks. Prefilling the rest on e0 would push out other blocks, which counts
    against it: at 70 % kept, e1 (room for all of it) takes the prompt, where the match
    alone (0.7 against e1's free share, 0.63) would keep it on e0; at 95 % e0 keeps it."""
    r, index, _, _ = setup()
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron")
    ids = messages_ids(tokenizer_json, body)
    n = len(ids) // BS
    k = round(n * kept)
    engine_holds(index, "e0", ids[: k * BS])
    engine_also_holds(index, "e0", list(range(1000, 1000 + 2 * n * BS)), "other")
    engine_holds(index, "e1", [])
    engine_also_holds(index, "e1", list(range(5000, 5000 + n * BS)), "other")
    e0.num_gpu_blocks = e1.num_gpu_blocks = index.size("e0")  # e0 full
    info = r.route_info("m", body, {})
    wait_ready(info)
    assert abs(1 - index.size("e1") / e1.num_gpu_blocks - 0.63) < 0.05
    assert {r.pick(pool, info).name for _ in range(20)} == {expect}


def test_no_exact_endpoint_falls_back_to_approximate_routing(setup, tokenizer_json):
    r, index, _, reg = setup()
    pool = make_pool(2)
    e0, _ = pool.endpoints
    body = chat(SYSTEM, "zeta eta")
    r.on_dispatch(e0, r.route_info("m", body, {}))
    info = r.route_info("m", body, {})
    wait_ready(info)
    assert {r.pick(pool, info).name for _ in range(10)} == {"e0"}
    assert 'how="not_exact"} 10' in reg.render().decode()


def test_tokens_not_ready_route_on_the_approximate_index_at_once(setup, tokenizer_json):
    r, index, precise, reg = setup()
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "theta iota")
    r.on_dispatch(e0, r.route_info("m", body, {}))
    engine_holds(index, "e0", [])
    engine_holds(index, "e1", messages_ids(tokenizer_json, body))
    info = r.route_info("m", chat(SYSTEM, "theta iota"), {})
    info.precise.chain = None  # as if the tokenizer thread had not got to it yet
    assert r.pick(pool, info).name == "e0"
    assert 'how="not_ready"} 1' in reg.render().decode()


def test_a_prefix_sent_before_its_tokens_were_ready_is_followed_once_they_are(setup, tokenizer_json):
    """A group's first request, picked before its tokens were ready, went by the
    approximate index. Its engine reports nothing yet (the prefill runs), so the exact
    side sees the prefix nowhere: the group's next request (tokens ready) follows the
    first rather than placing the prefix cold on another engine, a second cold prefill.
    Against vLLM this held a precise gateway's hit rate to round-robin's."""
    r, index, precise, _ = setup()
    pool = make_pool(2)
    for ep in pool.endpoints:
        engine_holds(index, ep.name, [])
        ep.num_gpu_blocks = 1000
    first = r.route_info("m", chat(SYSTEM, "theta iota kappa"), {})
    first.precise.chain = None  # the tokenizer thread has not got to it yet
    to = r.pick(pool, first)
    r.on_dispatch(to, first)
    picks = set()
    for q in ("lambda mu", "nu xi omicron", "pi rho", "sigma tau upsilon"):
        nxt = r.route_info("m", chat(SYSTEM, q), {})
        wait_ready(nxt)
        picks |= {r.pick(pool, nxt).name for _ in range(10)}
    assert picks == {to.name}


def test_a_next_turn_is_precise_at_once_and_tokenizes_only_its_new_messages(setup, tokenizer_json):
    r, index, precise, reg = setup()
    turn1 = chat(SYSTEM, "kappa lambda mu")
    info1 = r.route_info("m", turn1, {})
    wait_ready(info1)
    assert info1.precise.chain == chain_hashes(messages_ids(tokenizer_json, turn1), BS)

    def tokens():
        return reg.get("velocity_prefix_tokenized_tokens_total").get()

    before = tokens()
    turn2 = chat(SYSTEM, "kappa lambda mu", "nu xi", "omicron pi rho")
    info2 = r.route_info("m", turn2, {})
    # Ready on the event loop: the leading messages' blocks from the cache ...
    assert info2.precise.chain is not None
    whole2 = chain_hashes(messages_ids(tokenizer_json, turn2), BS)
    assert whole2[: len(info2.precise.chain)] == info2.precise.chain and len(info2.precise.chain) > 0
    wait_until = time.monotonic() + 5
    while info2.precise.chain != whole2 and time.monotonic() < wait_until:
        time.sleep(0.005)
    # ... then the whole prompt's, tokenizing only the two new messages.
    assert info2.precise.chain == whole2
    tok = Tokenizer.from_file(tokenizer_json)
    new = sum(
        len(tok.encode(f"<|im_start|>{r_}\n{c}<|im_end|>\n", add_special_tokens=False).ids)
        for r_, c in [("assistant", "nu xi"), ("user", "omicron pi rho")]
    )
    assert tokens() - before == new
    # The same prompt again is a whole hit: nothing to tokenize.
    info3 = r.route_info("m", turn2, {})
    assert info3.precise.chain == whole2
    assert 'velocity_prefix_token_cache_total{result="hit"} 1' in reg.render().decode()


def test_approximate_and_off_pools_have_no_token_side(setup, tokenizer_json):
    s = RoutingSettings(
        seed=1,
        default_profile="chat",
        prefix_modes={"a": "approximate", "o": "off"},
        prefix="precise",
        tokenizer=tokenizer_json,
    )
    precise = PrecisePrefix(s, BlockIndex(), block_size=lambda m: BS)
    try:
        r = Router(s, registry=Registry(), precise=precise)
        assert r.route_info("a", chat(SYSTEM, "x"), {}).precise is None
        off = r.route_info("o", chat(SYSTEM, "x"), {})
        assert off.precise is None and off.nblocks == 0  # off: load alone decides
        assert r.route_info("a", chat(SYSTEM, "x"), {}).nblocks > 0
        assert r.route_info("p", chat(SYSTEM, "x"), {}).precise is not None
    finally:
        precise.close()


def test_off_routes_by_load_alone():
    r = Router(RoutingSettings(seed=1, default_profile="chat", prefix="off"), registry=Registry())
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    body = chat(SYSTEM, "x")
    r.on_dispatch(e0, r.route_info("m", body, {}))
    e0.inflight = 1  # approximate affinity would keep it on e0 at this small a gap
    assert {r.pick(pool, r.route_info("m", body, {})).name for _ in range(10)} == {"e1"}


@pytest.mark.parametrize("accent", ["", "é"])
def test_a_shared_prefix_inside_one_message_is_matched_at_once(setup, tokenizer_json, accent):
    """The whole prompt in one message (a shared context, then a question): the second
    request finds the first's token blocks through their common byte blocks."""
    r, index, precise, reg = setup()
    context = " ".join(w + accent for w in (WORDS * 4)[:100])
    first = {"messages": [{"role": "user", "content": context + " alpha beta"}]}
    wait_ready(r.route_info("m", first, {}))
    second = {"messages": [{"role": "user", "content": context + " omega psi chi"}]}
    info = r.route_info("m", second, {})
    got = info.precise.chain
    whole = chain_hashes(messages_ids(tokenizer_json, second), BS)
    context_blocks = len(messages_ids(tokenizer_json, {"messages": [{"role": "user", "content": context}]})) // BS
    assert got is not None and whole[: len(got)] == got
    assert len(got) >= context_blocks - 4, (len(got), context_blocks)  # a byte block and the margin
    assert 'result="prefix"} 1' in reg.render().decode()


def test_completions_prompts_share_prefixes_too(setup, tokenizer_json):
    r, index, precise, reg = setup()
    context = " ".join((WORDS * 3)[:80])
    wait_ready(r.route_info("m", {"prompt": context + " alpha"}, {}))
    info = r.route_info("m", {"prompt": context + " omega"}, {})
    tok = Tokenizer.from_file(tokenizer_json)
    whole = chain_hashes(tok.encode(context + " omega").ids, BS)
    assert info.precise.chain is not None and whole[: len(info.precise.chain)] == info.precise.chain
    assert len(info.precise.chain) >= len(tok.encode(context).ids) // BS - 4
    wait_ready(info)
    deadline = time.monotonic() + 5
    while info.precise.chain != whole and time.monotonic() < deadline:
        time.sleep(0.005)
    assert info.precise.chain == whole


def test_a_tokenizer_without_chatml_markers_keeps_chat_approximate(tmp_path):
    """The chat template applied here is ChatML (as the sim's): with a tokenizer that does
    not know its markers the engine's template is another one, so chat requests stay on
    the approximate index instead of matching tokens the engine never saw."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    s = RoutingSettings(seed=1, default_profile="chat", prefix="precise", tokenizer=path)
    precise = PrecisePrefix(s, BlockIndex(), block_size=lambda m: BS)
    try:
        r = Router(s, registry=Registry(), precise=precise)
        assert r.route_info("m", chat(SYSTEM, "x"), {}).precise is None
        info = r.route_info("m", {"prompt": SYSTEM}, {})
        wait_ready(info)
        assert info.precise.chain == chain_hashes(tok.encode(SYSTEM).ids, BS)
    finally:
        precise.close()


def test_a_group_tokenized_twice_at_once_keeps_its_prefix_for_the_next_request(setup, tokenizer_json):
    """Two requests of one system prompt tokenized one after the other before either was
    ready: the second takes the system message from the per-message cache and must not
    enter the byte block just past it with fewer token blocks than the first did (its
    group's later requests found no tokens there, and were routed approximately)."""
    r, index, precise, reg = setup()
    # The system message ends 6 bytes before a 64-byte block's end, so that block holds
    # the message boundary and the start of the user's question (common to all three).
    head = len(b"\x1esystem\x1f")
    content = " ".join(WORDS * 4)
    content = content[: 64 * 4 - 6 - head].rstrip() + " "
    content += "x" * (64 * 4 - 6 - head - len(content))
    jobs = []
    precise.tokens._submit = jobs.append  # hold the tokenizer's jobs, then run them in order
    a = r.route_info("m", chat(content, "tau upsilon phi chi"), {})
    b = r.route_info("m", chat(content, "tau upsilon psi omega"), {})
    assert a.precise.chain is None and b.precise.chain is None and len(jobs) == 2
    for job in jobs:
        precise.tokens._tokenize(*job)
    jobs.clear()
    c = r.route_info("m", chat(content, "tau upsilon alpha beta"), {})
    system_blocks = len(messages_ids(tokenizer_json, chat(content))) // BS - 1
    assert c.precise.chain is not None and len(c.precise.chain) >= system_blocks
    whole = chain_hashes(messages_ids(tokenizer_json, chat(content, "tau upsilon alpha beta")), BS)
    assert whole[: len(c.precise.chain)] == c.precise.chain

"""The sim engine with a real tokenizer (--tokenizer tokenizer.json): prompts are counted,
cached and published as that tokenizer's ids after a ChatML chat template."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.kvevents import vllm_wire as W
from tests.kvevents.test_sim_kv_events import BS, TOPIC, Listener, endpoints, events_config, post, sim_flags
from tests.support.sim import REPO, sim_engine
from velocity_fast.kvevents.index import BlockIndex, chain_hashes
from velocity_fast.kvevents.subscriber import Subscriber

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant that answers briefly",
    "what is the capital of france and why",
    "paris is the capital of france",
    "system user assistant",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"])
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


@pytest.mark.timeout(60)
def test_chat_prompts_are_the_tokenizers_ids(tokenizer_json):
    tok = Tokenizer.from_file(tokenizer_json)
    messages = [
        {"role": "system", "content": SENTENCES[1] + " " + SENTENCES[0]},
        {"role": "user", "content": SENTENCES[2]},
    ]
    ids = tok.encode(chatml(messages), add_special_tokens=False).ids
    assert len(ids) > 3 * BS and 0 not in ids  # every word known: no [UNK]
    # A model folder holding the tokenizer.json will do, as for vLLM's --tokenizer.
    folder = str(Path(tokenizer_json).parent)
    with sim_engine(*sim_flags(events_config()), "--tokenizer", folder, time_scale=50) as eng:
        pub, replay = endpoints(eng)
        lis = Listener(pub)
        idx = BlockIndex()
        sub = Subscriber(idx, "e", pub, replay, topic=TOPIC).start()
        try:
            status, body = post(eng, "/tokenize", {"messages": messages})
            assert status == 200 and json.loads(body)["tokens"] == ids
            status, body = post(eng, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
            assert status == 200, body
            assert json.loads(body)["usage"]["prompt_tokens"] == len(ids)
            lis.drain(lambda: any(e["type"] == "BlockStored" for e in lis.events()))
            st = [e for e in lis.events() if e["type"] == "BlockStored"][0]
            full = len(ids) // BS * BS
            assert st["token_ids"] == ids[:full] and st["parent_block_hash"] is None
            # The gateway's own hashes of the same ids match every full block.
            chain = chain_hashes(ids, BS)
            W.wait_for(lambda: idx.match("e", chain) == len(chain), what="index")
            # A completions prompt is the tokenizer's ids of the text.
            text = SENTENCES[3] + " " + SENTENCES[0]
            status, body = post(eng, "/v1/completions", {"prompt": text, "max_tokens": 1})
            assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == len(tok.encode(text).ids)
        finally:
            sub.stop()
            lis.close()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer"),
        (["--kv-events-config", "{not json"], "--kv-events-config"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'], "kafka"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoints": "tcp://*:1"}'], "endpoints"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, says):
    r = subprocess.run(
        [sys.executable, "-m", "velocity_fast.sim", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(REPO),
    )
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_an_events_port_in_use_exits_2_before_listening():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{taken.getsockname()[1]}"})
        r = subprocess.run(
            [sys.executable, "-m", "velocity_fast.sim", "--port", "0", "--kv-events-config", cfg],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(REPO),
        )
    assert r.returncode == 2 and "already in use" in r.stderr and "listening" not in r.stdout, r.stderr


def test_events_off_publish_nothing():
    # No --kv-events-config (or events disabled): no socket, and no stderr line for one.
    cfg = json.dumps({"enable_kv_cache_events": False, "endpoint": "tcp://127.0.0.1:*"})
    with sim_engine("--kv-events-config", cfg, time_scale=50) as eng:
        status, _ = post(eng, "/v1/completions", {"prompt": "hello " * 40, "max_tokens": 1})
        assert status == 200 and "kv events on" not in eng.stderr_text

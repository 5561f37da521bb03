"""The sim held to vLLM: the fidelity script's calls to a real vLLM CPU engine and to a sim
serving the same model name with the model's own tokenizer and vLLM's block size. Every
difference in what a gateway or a client reads is either gone or declared deliberate (with
its reason, in velocity_fast/sim/fidelity.py and docs/design.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.sim import sim_engine
from tests.vllm.support.engines import MAX_MODEL_LEN, MAX_NUM_SEQS
from velocity_fast.sim import fidelity

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

VLLM_BLOCK_SIZE = 128  # vLLM's CPU default (vllm:cache_config_info)


def test_the_sim_answers_as_vllm_does(chatml, tmp_path):
    eng = chatml.engines[0]
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/sim.kv", "topic": "kv"}
    tokenizer = Path(chatml.model_dir) / "tokenizer.json"
    with sim_engine(
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",
        str(VLLM_BLOCK_SIZE),
        "--tokenizer",
        str(tokenizer),
        "--kv-events-config",
        json.dumps(kv),
        model=chatml.model,
    ) as sim:
        vllm_obs = fidelity.observe(eng.url, chatml.model, eng.pub, "kv", MAX_MODEL_LEN)
        sim_obs = fidelity.observe(sim.url, chatml.model, kv["endpoint"], "kv", MAX_MODEL_LEN)
    rep = fidelity.compare(sim_obs, vllm_obs)
    # The reductions are real: both engines answered every call, and events came from both.
    assert vllm_obs["chat:status"] == sim_obs["chat:status"] == 200
    assert "kv:BlockStored.block_hashes[]" in vllm_obs
    assert not rep.undeclared, rep.text()

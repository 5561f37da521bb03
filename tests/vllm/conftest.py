"""The vllm tier's engines: real vLLM CPU engines, started once per session and shared.

At most one pair runs at a time (each engine takes about a core and 2.8 GB while it
starts): asking for the other model's pair stops the first. The pair of the ChatML model
keeps vLLM's default replay buffer; the Llama-3-style model's keeps 4 batches, so that a
gateway joining it after some traffic finds batch 0 gone, as it does on engines that have
run for hours.
"""

from __future__ import annotations

import pytest

from tests.vllm.support.engines import EnginePair, build_models, vllm_env

PAIRS = {"chatml": ("tiny-chatml", None), "llama3": ("tiny-llama3", 4)}


class Pairs:
    def __init__(self, py, models, log_dir) -> None:
        self.py, self.models, self.log_dir = py, models, log_dir
        self.current: tuple[str, EnginePair] | None = None

    def get(self, kind: str) -> EnginePair:
        if self.current is not None and self.current[0] == kind:
            return self.current[1]
        self.close()
        served, buffer_steps = PAIRS[kind]
        pair = EnginePair(
            self.py, self.models[kind], served, self.log_dir, prefix=f"{kind}-", buffer_steps=buffer_steps
        ).start()
        self.current = (kind, pair)
        return pair

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None


@pytest.fixture(scope="session")
def vllm_pairs(tmp_path_factory):
    py = vllm_env()
    models = build_models(py)
    pairs = Pairs(py, models, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield pairs
    finally:
        pairs.close()


@pytest.fixture
def chatml(vllm_pairs) -> EnginePair:
    return vllm_pairs.get("chatml")


@pytest.fixture
def llama3(vllm_pairs) -> EnginePair:
    return vllm_pairs.get("llama3")

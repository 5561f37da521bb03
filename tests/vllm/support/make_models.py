"""Build the vllm tier's tiny models: random weights, a BPE tokenizer trained on the
repository's own text, and a chat template; no download. Run with the vLLM venv's Python:

    .vllm-venv/bin/python tests/vllm/support/make_models.py DIR

It writes DIR/chatml (ChatML markers) and DIR/llama3 (Llama-3 headers, a BOS token in the
template), each a folder vLLM serves as ``--model DIR/NAME``. Output is gibberish; the
gateway reads only what vLLM does with it (tokens, blocks, usage, metrics). A folder that
already holds a finished model (its ``done`` file) is kept.
"""

from __future__ import annotations

import glob
import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

MODELS = {
    "chatml": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "template": CHATML,
    },
    "llama3": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
        "template": LLAMA3,
    },
}


def _corpus() -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    return [open(f, encoding="utf-8").read() for f in files if os.path.exists(f)]


def build(out: str, name: str, vocab: int = 4096, seed: int = 0) -> str:
    spec = MODELS[name]
    path = os.path.join(out, name)
    if os.path.exists(os.path.join(path, "done")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["pad"], model_max_length=4096
    )
    fast.chat_template = spec["template"]
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    ids = {t: tok.token_to_id(t) for t in spec["special"]}
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=ids.get(spec["bos"]),
        eos_token_id=ids[spec["eos"]],
        pad_token_id=ids[spec["pad"]],
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    with open(os.path.join(path, "done"), "w") as f:
        f.write(json.dumps({"vocab": tok.get_vocab_size()}) + "\n")
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for name in MODELS:
        print(build(argv[0], name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

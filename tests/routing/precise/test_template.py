"""The chat template and tokenizer loading that precise routing and the sim engine share
(routing/precise/template.py): one rendering, so the gateway's token blocks are the
engine's, and one loader, whose refusals say who needs the tokenizer and why."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from velocity_fast.routing.precise.template import chat_template, load_renderer, load_tokenizer, message_texts
from velocity_fast.sim.tokens import TextTokenizer


@pytest.fixture
def tokenizer_json(tmp_path):
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, "user": 3, "assistant": 4, "hi": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_the_template_is_chatml_with_the_assistants_opening():
    text = chat_template([("system", "be brief"), ("user", "hi")])
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_only_text_parts_of_a_content_list_count():
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {}},
                {"type": "text", "text": "b"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    assert message_texts(msgs) == [("user", "ab"), ("assistant", "")]


def test_the_sim_engine_tokenizes_a_chat_through_the_same_template(tokenizer_json):
    sim = TextTokenizer(str(tokenizer_json.parent))  # a model folder will do, as for vLLM
    msgs = [("user", "hi")]
    want = load_tokenizer(str(tokenizer_json)).encode(chat_template(msgs), add_special_tokens=False).ids
    assert sim.encode_chat(msgs) == want == [1, 3, 5, 2, 1, 4]


def test_a_missing_or_broken_tokenizer_is_refused_naming_who_needs_it(tmp_path):
    with pytest.raises(ValueError, match=r"^precise prefix routing: tokenizer .*nothing.json: cannot load"):
        load_tokenizer(str(tmp_path / "nothing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^--tokenizer: tokenizer .*: cannot load a tokenizer.json"):
        TextTokenizer(str(tmp_path))


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def test_a_models_own_template_is_rendered_as_vllm_renders_it(tmp_path):
    # chat_template.jinja first (what transformers saves), with the special tokens of
    # tokenizer_config.json; the rendering a non-ChatML model's engine tokenizes.
    (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "chat_template": "ignored: the .jinja wins"})
    )
    r = load_renderer(str(tmp_path))
    texts = [("system", "be brief "), ("user", "hi")]
    assert r.render(texts) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert r.stable and not r.chatml
    assert "".join(r.pieces(texts)) + r.gen == r.render(texts)
    assert r.pieces(texts)[0].startswith("<|begin_of_text|>")


def test_tokenizer_configs_template_and_chatml_without_one(tmp_path):
    cfg = {
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA3}],
        "bos_token": "<s>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_renderer(str(tmp_path / "tokenizer.json")).render([("user", "hi")]).startswith("<s><|start_header_id|>")
    bare = tmp_path / "bare"
    bare.mkdir()
    r = load_renderer(str(bare))
    assert r.chatml and r.render([("user", "hi")]) == chat_template([("user", "hi")])


def test_a_template_that_does_not_render_is_refused_saying_so(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="chat_template.jinja: cannot render a conversation: no system role"):
        load_renderer(str(tmp_path))

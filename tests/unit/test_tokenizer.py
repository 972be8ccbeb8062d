"""Tokenizer loading (embedded GGUF, GGUF files, Hugging Face folders) and chat templates."""

from __future__ import annotations

import json
import os

import gguf
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenmill.errors import InvalidParameterError
from tokenmill.model_source import default_model_path
from tokenmill.tokenizer.gguf_vocab import build_byte_level_bpe, read_gguf_metadata
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

SAMPLES = [
    "Hello world",
    "  2 spaces then a digit, 3.14159 and 2024-01-31",
    "x  12\n\n\n  indented\tTab",
    "émoji 😀 and 中文字符, 👨‍👩‍👧 family, 🇫🇷 flag",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>",
]


def token_strings(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.backend.id_to_token(i) for i in ids]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def smol_metadata() -> dict:
    return read_gguf_metadata(default_model_path())


def test_embedded_tokenizer_basics(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.eos_token_ids == frozenset({0, 2})  # <|endoftext|> ends generation too
    assert token_strings(smol, [0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smol.encode("Hello world") == [19556, 905]
    assert load_tokenizer(None) is smol  # loaded once per process


def test_gguf_tokenizer_splits_like_the_smollm_pretokenizer(smol, smol_metadata) -> None:
    # The original tokenizer splits digits individually before the GPT-2 byte-level split,
    # so a run of spaces before a digit stays one token ("ĠĠ"); the plain GPT-2 split
    # (what transformers' GGUF conversion uses) would give "Ġ", "Ġ".
    assert token_strings(smol, smol.encode("  2")) == ["ĠĠ", "2"]
    reference = RustTokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(smol_metadata["tokenizer.ggml.tokens"])},
        merges=[tuple(m.split(" ")) for m in smol_metadata["tokenizer.ggml.merges"]]))
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    reference.decoder = decoders.ByteLevel()
    for text in SAMPLES[:-1]:  # the last one holds special tokens the bare reference lacks
        assert smol.encode(text) == reference.encode(text).ids, text
        assert smol.decode(smol.encode(text)) == text


def test_special_tokens_are_whole_and_skipped_when_decoding(smol: Tokenizer) -> None:
    ids = smol.encode(SAMPLES[-1])
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == SAMPLES[-1]
    assert smol.decode(smol.encode("<jupyter_code>x")) == "x"  # every control token is special


def test_encode_adds_bos_when_the_gguf_asks(smol_metadata) -> None:
    plain = build_byte_level_bpe(smol_metadata)
    with_bos = build_byte_level_bpe({**smol_metadata, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("Hi there").ids == [1, *plain.encode("Hi there").ids]
    assert with_bos.encode("Hi there", add_special_tokens=False).ids == plain.encode(
        "Hi there").ids


def test_chat_template_renders_chatml(smol: Tokenizer) -> None:
    ids = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert smol.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids[-3:] == smol.encode("<|im_start|>assistant\n")[-3:]
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert smol.render_chat(convo, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_content_parts_are_flattened(smol: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert smol.apply_chat_template([{"role": "user", "content": parts}]) == \
        smol.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert "assistant\n<|im_end|>" in smol.render_chat(
        [{"role": "assistant", "content": None}], add_generation_prompt=False)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": 3}],
    [{"content": "no role"}],
    [],
    "not a list",
])
def test_bad_messages_raise_invalid_parameter(smol: Tokenizer, messages) -> None:
    with pytest.raises(InvalidParameterError) as info:
        smol.apply_chat_template(messages)
    assert info.value.param == "messages"


def _write_tiny_hf_folder(folder, chat_template_in_config: bool) -> PreTrainedTokenizerFast:
    words = ["<s>", "</s>", "<eot>", "<unk>", "hello", "world", "!", "Ġ"]
    backend = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                             unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", additional_special_tokens=["<eot>"],
                                 chat_template=template if chat_template_in_config else None)
    hf.save_pretrained(folder)
    if not chat_template_in_config:
        for leftover in ("chat_template.jinja", "chat_template.json"):
            if os.path.exists(os.path.join(folder, leftover)):
                os.remove(os.path.join(folder, leftover))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 2]}, f)
    return hf


def test_hf_folder_tokenizer(tmp_path) -> None:
    hf = _write_tiny_hf_folder(tmp_path, chat_template_in_config=True)
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == frozenset({1, 2})  # </s> plus generation_config's list
    assert tok.vocab_size == len(hf) == 8
    assert tok.encode("hello world !") == hf.encode("hello world !") == [4, 5, 6]
    assert tok.decode([0, 4, 5, 1]) == "hello world"
    assert tok.apply_chat_template([{"role": "hello", "content": "world"}]) == [0, 4, 5, 1]


def test_hf_folder_chat_template_from_jinja_file(tmp_path) -> None:
    _write_tiny_hf_folder(tmp_path, chat_template_in_config=False)
    assert load_tokenizer(str(tmp_path)).chat_template is None
    other = tmp_path / "with_jinja"
    _write_tiny_hf_folder(other, chat_template_in_config=False)
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(str(other)).apply_chat_template(
        [{"role": "user", "content": "hello"}]) == [4]


def test_template_errors(tmp_path) -> None:
    _write_tiny_hf_folder(tmp_path, chat_template_in_config=False)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages[0]['content'] }}")
    tok = load_tokenizer(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [4]
    with pytest.raises(InvalidParameterError, match="user first") as info:
        tok.apply_chat_template([{"role": "system", "content": "hello"}])
    assert info.value.param == "messages"
    broken = tmp_path / "broken"
    _write_tiny_hf_folder(broken, chat_template_in_config=False)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not valid Jinja") as info:
        load_tokenizer(str(broken)).apply_chat_template([{"role": "user", "content": "x"}])
    assert not isinstance(info.value, InvalidParameterError)


def test_missing_chat_template_is_a_clear_error(tmp_path) -> None:
    _write_tiny_hf_folder(tmp_path, chat_template_in_config=False)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_paths_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_tokenizer(str(tmp_path / "weights.bin"))
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + b"\0" * 16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(str(tmp_path / "fake.gguf"))


def _write_tokenizer_gguf(path, metadata: dict, pre: str) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_float32("test.float", 0.5)
    writer.add_array("test.ints", [3, -4, 5])
    writer.add_bool("test.flag", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_metadata_reader_and_eos_ids(tmp_path, smol_metadata) -> None:
    path = tmp_path / "custom.gguf"
    _write_tokenizer_gguf(path, smol_metadata, pre="llama-bpe")
    meta = read_gguf_metadata(str(path))
    assert meta["test.float"] == 0.5 and meta["test.ints"] == [3, -4, 5]
    assert meta["test.flag"] is True
    assert meta["tokenizer.ggml.tokens"] == smol_metadata["tokenizer.ggml.tokens"]
    assert load_tokenizer(str(path)).eos_token_ids == frozenset({0, 2})  # EOS, end-of-turn


def test_an_unknown_pre_tokenizer_is_one_clear_error(tmp_path, smol_metadata) -> None:
    # llama.cpp refuses it too; splitting some other way would give other token ids
    path = tmp_path / "custom.gguf"
    _write_tokenizer_gguf(path, smol_metadata, pre="an-unlisted-pre-tokenizer")
    with pytest.raises(ValueError, match=r"custom\.gguf: .*pre-tokenizer "
                                         r"'an-unlisted-pre-tokenizer'.*supported: .*qwen2"):
        load_tokenizer(str(path))


TEMPLATES = {
    "bos and loop controls": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}"
        "{% endif %}<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"),
    "namespace, tojson and tools": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m | tojson }}{% endfor %}{{ ns.n }}{% if tools %}{{ tools | tojson(indent=2) }}"
        "{% endif %}"),
    "generation blocks": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_chat_templates_render_as_transformers_renders_them(tmp_path, name) -> None:
    hf = _write_tiny_hf_folder(tmp_path, chat_template_in_config=False)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES[name])
    hf.chat_template = TEMPLATES[name]
    tok = load_tokenizer(str(tmp_path))
    messages = [{"role": "system", "content": "  Sé brief ✓ "}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    for add_generation_prompt in (True, False):
        assert tok.render_chat(messages, add_generation_prompt) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_embedded_chat_template_renders_as_transformers_renders_it(smol: Tokenizer) -> None:
    hf = PreTrainedTokenizerFast(tokenizer_object=smol.backend, bos_token="<|im_start|>",
                                 eos_token="<|im_end|>", chat_template=smol.chat_template)
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"},
                      {"role": "user", "content": "Bye"}]):
        assert smol.render_chat(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)

"""Chat templates of real model families render as transformers renders them.

``tests/data/chat_templates/`` holds the templates of Gemma 2/3, Qwen2.5, Qwen3, Llama 3.1,
Phi-3.5, Mistral Nemo and Mistral Small 3.2, as their Hugging Face repositories publish
them. Each conversation below is rendered by tokenmill's ``ChatTemplate`` and by
transformers' ``apply_chat_template`` on the same special tokens; a conversation a
template rejects (``raise_exception``) must be rejected by both.
"""

from __future__ import annotations

import glob
import os

import pytest
from transformers import PreTrainedTokenizerFast

from tokenmill.tokenizer.chat_template import ChatTemplate
from tokenmill.tokenizer.tokenizer import load_tokenizer
from vocab_files import VOCAB_DIR

TEMPLATE_DIR = os.path.join(os.path.dirname(VOCAB_DIR), "chat_templates")
TEMPLATES = sorted(glob.glob(os.path.join(TEMPLATE_DIR, "*.jinja")))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hi ✓"}],
    "system and turns": [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hey"}, {"role": "user", "content": " Bye  "}],
    "alternation broken": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "tool round trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "a1b2c3d4e", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "sunny"}],
}


@pytest.fixture(scope="module")
def reference() -> PreTrainedTokenizerFast:
    backend = load_tokenizer(os.path.join(VOCAB_DIR, "phi-3.gguf")).backend
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL)


def _render_hf(reference, template: str, messages, tools, add_generation_prompt: bool):
    try:
        return reference.apply_chat_template(messages, tools=tools, chat_template=template,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # noqa: BLE001 - jinja2's TemplateError or the template's own
        return type(error).__name__


def _render_ours(template: ChatTemplate, messages, tools, add_generation_prompt: bool):
    try:
        return template.render(messages, add_generation_prompt, tools=tools)
    except Exception as error:  # noqa: BLE001 - as above
        return type(error).__name__


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: os.path.basename(p)[:-6])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_real_template_renders_as_transformers(reference, path, conversation) -> None:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    template = ChatTemplate(source, SPECIAL)
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if conversation == "tool round trip" else None
    for add_generation_prompt in (True, False):
        ours = _render_ours(template, messages, tools, add_generation_prompt)
        theirs = _render_hf(reference, source, messages, tools, add_generation_prompt)
        if isinstance(theirs, str) and theirs.endswith(("Error", "Exception")):
            assert ours.endswith(("Error", "Exception")), (ours, theirs)
        else:
            assert ours == theirs

from __future__ import annotations

import json
import os

import pytest
from bench_standin import ServerThread, StandIn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def standin():
    """(StandIn, root URL); a test's base URL is f"{root}/{scenario}"."""
    stand_in = StandIn()
    with ServerThread(stand_in.app) as server:
        yield stand_in, server.url


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory) -> str:
    """A local Hugging Face tokenizer folder: one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0} | {f"w{i}": i + 1 for i in range(100)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("word_tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)

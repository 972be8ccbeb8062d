"""The added tokens, BOS and end-of-generation ids of a GGUF vocabulary, as llama.cpp
reads them; shared by the byte-level BPE and the SentencePiece builders.

llama.cpp matches a vocabulary's control, user-defined and unknown tokens whole in the
text before tokenizing what lies between them. Beyond the file's own token types it
treats the tokens spelled as in ``END_OF_GENERATION_TEXTS`` as control tokens that end
generation (a Qwen file names ``<|endoftext|>`` its EOS, yet a chat turn ends with
``<|im_end|>``), and in a Phi-3 file it drops the whitespace after most of them (the
``rstrip`` flags of Phi-3's own tokenizer). ``add_added_tokens`` gives the ``tokenizers``
backend the same tokens with the same flags.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # token_type values

END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>",
})
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.eom_token_id")
# Phi-3: whitespace after a special token is dropped, but after these
_PHI3_KEEP_WHITESPACE = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def token_kinds(metadata: dict[str, Any]) -> list[int]:
    """Each token's type, with llama.cpp's override: an end-of-generation text is CONTROL."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    return [CONTROL if text in END_OF_GENERATION_TEXTS else kind
            for text, kind in zip(tokens, types, strict=True)]


def end_of_generation_ids(metadata: dict[str, Any]) -> set[int]:
    """The ids that end generation: the file's EOS, end-of-turn and end-of-message ids,
    and every token spelled as in ``END_OF_GENERATION_TEXTS``."""
    ids = {metadata[key] for key in _EOS_KEYS if key in metadata}
    ids.update(i for i, text in enumerate(metadata["tokenizer.ggml.tokens"])
               if text in END_OF_GENERATION_TEXTS)
    return ids


def add_added_tokens(tok: Tokenizer, metadata: dict[str, Any]) -> None:
    """Control and unknown tokens as special added tokens (skipped when decoding with
    ``skip_special_tokens``), user-defined ones as plain added tokens."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    phi3 = any(name in metadata.get("general.name", "").lower() for name in ("phi-3", "phi3"))
    special, plain = [], []
    for text, kind in zip(tokens, token_kinds(metadata), strict=True):
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED):
            continue
        rstrip = phi3 and text not in _PHI3_KEEP_WHITESPACE
        added = AddedToken(text, special=kind != USER_DEFINED, normalized=False, rstrip=rstrip)
        (plain if kind == USER_DEFINED else special).append(added)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def add_bos(tok: Tokenizer, metadata: dict[str, Any], default: bool) -> None:
    """Put the BOS token in front of encodings made with ``add_special_tokens=True`` when
    the file asks for it (``tokenizer.ggml.add_bos_token``, else ``default``)."""
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if not metadata.get("tokenizer.ggml.add_bos_token", default) or bos_id is None:
        return
    bos = metadata["tokenizer.ggml.tokens"][bos_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)])

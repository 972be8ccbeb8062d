"""Build the SentencePiece-style tokenizer a GGUF file describes (``tokenizer.ggml.model
== "llama"``: Llama 2, Mistral, Phi-3, Gemma and others), as llama.cpp tokenizes it.

llama.cpp's SentencePiece tokenizer (its "SPM" vocabulary) works on a text fragment
between added tokens like this: put a space in front when the file asks for one
(``tokenizer.ggml.add_space_prefix``, true unless the file says otherwise) and the
fragment starts the text or follows an added token; write every space as ``▁``; split
into characters; merge, again and again, the adjacent pair whose concatenation is the
vocabulary token of highest score; spell any piece left outside the vocabulary with its
byte tokens (``<0x41>``), or the unknown token.

That is byte-pair encoding whose merge ranks follow the scores of the merged tokens, so
``build_sentencepiece`` hands it to the ``tokenizers`` library as a BPE model with byte
fallback: a ``Prepend("▁")`` normalizer, which the library applies to each fragment
between added tokens just as llama.cpp adds its space, and merges ranked by the merged
token's score (ties: the lower token id first). The added tokens are ``gguf_tokens``'
(control, unknown and user-defined ones, with llama.cpp's overrides); byte and unused
tokens stay in the model's vocabulary only.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

from tokenmill.tokenizer.gguf_tokens import add_added_tokens, add_bos

SPACE = "▁"


def supports_sentencepiece(metadata: dict[str, Any]) -> bool:
    """Whether ``build_sentencepiece`` reproduces this file's tokenizer."""
    return (metadata.get("tokenizer.ggml.model") == "llama"
            and "tokenizer.ggml.scores" in metadata
            and "tokenizer.ggml.merges" not in metadata)


def build_sentencepiece(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a ``supports_sentencepiece`` file (see the module docstring).

    With ``add_special_tokens=True`` encodings start with the BOS token when the file asks
    for one (``tokenizer.ggml.add_bos_token``, true by default for this kind, as in
    llama.cpp). Decoding drops the space the prefix added in front of the first token.
    """
    assert supports_sentencepiece(metadata), "caller checks supports_sentencepiece"
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata["tokenizer.ggml.scores"]
    vocab = {token: i for i, token in enumerate(tokens)}
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, vocab),
                               unk_token=tokens[unknown_id], fuse_unk=True,
                               byte_fallback=True))
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend(SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decoding = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decoding, decoders.Strip(" ", 1, 0)] if add_prefix
                                    else decoding)
    add_added_tokens(tok, metadata)
    add_bos(tok, metadata, default=True)
    return tok


def _merges_by_score(tokens: list[str], scores: list[float],
                     vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a vocabulary token into two vocabulary tokens, ranked by the token's
    score (highest first; ties by token id, then by the left piece's length)."""
    ranked = []
    for token_id, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]

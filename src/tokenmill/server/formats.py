"""How a choice's delta is spelled in each endpoint's JSON (completions vs chat)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.types import TokenLogprob
from tokenmill.tokenizer.tokenizer import Tokenizer


class CompletionFormat:
    object_stream = "text_completion"
    object_full = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text, as OpenAI reports it (special tokens included)."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def stream_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                      finish_reason: str | None, stop_reason, first: bool) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def full_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                    finish_reason: str | None, stop_reason) -> dict:
        return self.stream_choice(index, text, logprobs, finish_reason, stop_reason, True)

    def logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        tokens = self.token_texts([e.token_id for e in entries])
        tops = []
        for entry in entries:
            names = self.token_texts([t for t, _ in entry.top])
            tops.append({name: lp for name, (_, lp) in zip(names, entry.top, strict=True)})
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": []}


class ChatFormat(CompletionFormat):
    object_stream = "chat.completion.chunk"
    object_full = "chat.completion"
    id_prefix = "chatcmpl-"

    def stream_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                      finish_reason: str | None, stop_reason, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def full_choice(self, index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                    finish_reason: str | None, stop_reason) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            [token] = self.token_texts([entry.token_id])
            names = self.token_texts([t for t, _ in entry.top])
            content.append({
                "token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": name, "logprob": lp, "bytes": list(name.encode())}
                                 for name, (_, lp) in zip(names, entry.top, strict=True)],
            })
        return {"content": content}

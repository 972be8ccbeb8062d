"""``POST /v1/embeddings``: OpenAI's embeddings, from the engine that generates.

Each input becomes one pooling request (``PoolingParams``), scheduled as a prompt beside
the generation traffic; the response holds one vector per input, in input order, as
floats or as base64 of little-endian float32 (OpenAI's ``encoding_format``). The pooling
is the server's (``--pooling``, default last token); ``normalize`` (vLLM's extra field)
overrides ``--[no-]embedding-normalize`` per request. ``usage.prompt_tokens`` counts every
input's tokens. ``dimensions`` is refused: a decoder's vectors have its hidden size.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.responses import Response
from starlette.types import Receive

from tokenmill.errors import InvalidParameterError
from tokenmill.frontend.async_client import RequestStream
from tokenmill.sampling_params import PoolingParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import Text, TokenIds, text_or_token_list
from tokenmill.server.serving import OpenAIServing, respond_json


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: Text | list[Text] | TokenIds | list[TokenIds]
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: Text | None = None
    # vLLM's extras
    normalize: StrictBool | None = None  # None: the server's --[no-]embedding-normalize
    priority: Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)] = 0

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a text or a list of token ids."""
        return text_or_token_list(self.input, "input")


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing, pooling: PoolingParams) -> None:
        self.serving = serving
        self.pooling = pooling

    async def create(self, body: EmbeddingRequest, request_id: str,
                     receive: Receive) -> Response:
        serving = self.serving
        serving.check_model(body.model)
        if body.dimensions is not None:
            raise InvalidParameterError(
                "dimensions is not supported by this model: its embeddings have the size of "
                "its hidden states", "dimensions")
        inputs = body.inputs()
        serving.server_config.limits.check_num_prompts(len(inputs))
        processor = serving.processor
        prompt_ids = [processor.tokenize(x, "input") for x in inputs]
        pooling = (self.pooling if body.normalize is None
                   else replace(self.pooling, normalize=body.normalize))
        processor.check_priority(body.priority)
        engine_id = uuid.uuid4().hex
        core_requests = [replace(processor.make_pooling_request(f"{engine_id}-e{i}", ids, pooling),
                                 priority=body.priority)
                         for i, ids in enumerate(prompt_ids)]
        stream = serving.engine.add_request(core_requests, time.monotonic(), request_id)
        return await respond_json(stream, self._collect(stream, body, prompt_ids), receive)

    async def _collect(self, stream: RequestStream, body: EmbeddingRequest,
                       prompt_ids: list[list[int]]) -> dict:
        vectors: dict[int, tuple[float, ...]] = {}
        async for delta in stream:
            if delta.finish_reason == "error" or (delta.finished and delta.embedding is None):
                raise APIError(500, stream.error or "the engine failed this request")
            if delta.embedding is not None:
                vectors[delta.index] = delta.embedding
        num_tokens = sum(len(ids) for ids in prompt_ids)
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(vectors[i], body.encoding_format)}
                     for i in range(len(prompt_ids))],
            "model": self.serving.server_config.served_model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }


def _encoded(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

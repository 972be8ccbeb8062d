"""What the APIs served over the chat path share (the Responses API, Anthropic's Messages).

Such an API turns its request into a ``ChatCompletionRequest``; ``ChatShapedServing.open``
checks, renders and starts it through ``OpenAIServing`` (an error names the API's own
field, by ``renames``), and ``blocks`` turns the choice's chat deltas into the events of
its ``BlockAssembler``. ``reply`` answers with the API's event stream, or with its full
body once the same feed has run to the end, so that streamed and full answers agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from starlette.types import Receive

from tokenmill.errors import InvalidParameterError
from tokenmill.server.blocks import BlockAssembler, BlockEvent
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import ChatPlan, EngineFailed, Job, OpenAIServing


@dataclass(slots=True)
class Output:
    """One request's single choice being built: its blocks and how it ended."""

    job: Job
    plan: ChatPlan
    assembler: BlockAssembler = field(default_factory=BlockAssembler)
    finish: tuple[str, object] | None = None  # the chat choice's finish and stop reasons
    error: str | None = None  # why the engine failed it

    @property
    def key(self) -> str:
        """The request's id, for the ids of the response and its parts."""
        return self.job.response_id.partition("-")[2]


class ChatShapedServing:
    renames: ClassVar[dict[str, str]] = {}  # the chat field an error names -> the API's

    def __init__(self, serving: OpenAIServing, model: str) -> None:
        """``model``: the served model's name, as responses show it."""
        self.serving = serving
        self.model = model

    def renamed(self, error: InvalidParameterError) -> InvalidParameterError:
        """A chat request's error, naming this API's field."""
        return InvalidParameterError(str(error),
                                     self.renames.get(error.param or "", error.param))

    async def plan(self, body: ChatCompletionRequest) -> ChatPlan:
        try:
            return await self.serving.plan_chat(body)
        except InvalidParameterError as e:
            raise self.renamed(e) from None

    async def open(self, body: ChatCompletionRequest, request_id: str) -> Output:
        plan = await self.plan(body)
        try:
            job = self.serving.start(plan.params, request_id, [plan.prompt_ids], None,
                                     plan.format, plan.reasoning)
        except InvalidParameterError as e:
            raise self.renamed(e) from None
        return Output(job, plan)

    async def blocks(self, output: Output) -> AsyncIterator[BlockEvent]:
        """The block events of ``output``'s choice; ``EngineFailed`` when the engine fails."""
        async for delta, choice in self.serving.chat_deltas(output.job, output.plan.format):
            if choice is not None:
                for event in output.assembler.feed(choice["delta"]):
                    yield event
                if choice["finish_reason"] is not None:
                    output.finish = (choice["finish_reason"], choice["stop_reason"])
            if delta.finished:
                for event in output.assembler.finish():
                    yield event

    async def reply(self, output: Output, stream: bool, events: AsyncIterator[str],
                    body: Callable[[], dict], receive: Receive):
        """``events`` as a stream, or ``body()`` once ``blocks`` has run to the end."""
        if stream:
            return self.serving.stream_response(output.job, events)
        return await self.serving.respond(output.job, self._full(output, body), receive)

    async def _full(self, output: Output, body: Callable[[], dict]) -> dict:
        try:
            async for _ in self.blocks(output):
                pass
        except EngineFailed as e:
            raise APIError(500, str(e)) from None
        return body()

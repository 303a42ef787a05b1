"""The OpenAI Responses API (`/v1/responses`) as msgspec Structs: the request, the response object,
its output items and the typed stream events, in the shapes the official client parses.

A request maps onto a chat completion request (`ResponsesRequest.chat_request`), so it is validated,
rendered and sampled exactly like one: input items become chat messages, `instructions` a system
message first, flat function tools the chat tools, `text.format` the `response_format`,
`reasoning.effort` the `reasoning_effort`, and vLLM's sampling extensions their chat fields. Every
other field of OpenAI's and vLLM's request models is either echoed on the response (it changes
nothing this server does, e.g. `max_tool_calls`: it bounds built-in tools, and none run here) or
refused with a 400 naming it (`REFUSED_FIELDS`, `LIMITED_FIELDS`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from corectl.sampling_params import MAX_LOGPROBS
from msgspec import Meta

from .constraints import JsonSchemaFormat, ResponseFormat, StructuredOutputsRequest
from .errors import APIError
from .protocol import INT32_MAX, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_STRINGS, CacheSalt, ChatCompletionRequest, \
    ChatMessage, Int64, RequestId, StopString, TemplateKwargs
from .responses import ChatLogprob
from .tools import MAX_TOOLS, ChatTool, FunctionCallIn, FunctionDefinition, FunctionName, NamedFunction, \
    NamedToolChoice, ToolCallIn
from .vllm_fields import check_limited_fields

_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text")
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's `include` values. Those about built-in tools' items or input images ask for parts of
# items this server never makes (it runs function tools only and takes text input only).
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]

# Request fields (OpenAI's and vLLM's) this server cannot honour -> why. One sent with anything but
# null or false gets a 400 naming it.
REFUSED_FIELDS = {
    "background": "background responses (polled and cancelled later) are not served; send the request in the "
                  "foreground, or stream it",
    "background_options": "background responses are not served",
    "conversation": "the Conversations API is not served; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not served",
    "previous_response": "send previous_response_id, or the whole conversation as input",
    "previous_input_messages": "send the earlier turns as input items",
    "enable_response_messages": "the rendered input and output messages are not returned",
    "mm_processor_kwargs": "input here is text only (input_image parts are refused), so no image is processed",
    "context_management": "context compaction is not served",
    "prompt_cache_options": "the prefix cache is automatic: explicit breakpoints and lifetimes are not served",
    "access_programs": "no access programs are served",
    "image": "input here is text only",
    "moderation": "moderation is not served",
}
# Fields (dotted: nested) with only some values honoured -> (those values, why the others are not).
LIMITED_FIELDS = {
    "service_tier": (("auto", "default"), "this server has one service tier, \"default\" (`priority` orders "
                     "requests)"),
    "truncation": (("disabled",), "dropping the oldest input items to fit the context is not served; an input "
                   "past the context is a 400, as with \"disabled\""),
    "prompt_cache_retention": (("in_memory",), "the prefix cache is kept in memory, least recently used out first"),
    "reasoning.summary": (("auto",), "reasoning items carry the whole reasoning text, never a summary"),
    "reasoning.generate_summary": (("auto",), "reasoning items carry the whole reasoning text, never a summary"),
    "reasoning.context": (("auto", "current_turn"), "earlier turns' reasoning is never rendered back to the model"),
    "text.verbosity": (("medium",), "the model has no verbosity setting"),
    "stream_options.include_obfuscation": ((False,), "stream events carry no obfuscation padding"),
}


class InputPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One `input` item: a message (`role` and `content`, `type` "message" or left out), a function
    call of an earlier turn, the output of one, or an earlier reasoning item (not replayed)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A Responses function tool: the chat tool's `function` fields, flat."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: plain text, any JSON object, or JSON matching `schema` (named by `name`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Meta(max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)
    verbosity: str | None = None  # LIMITED_FIELDS


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    # Chat's reasoning_effort values, which templates and harmony read.
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses: the fields of OpenAI's create() and of vLLM's ResponsesRequest."""

    input: str | Annotated[list[InputItem], Meta(max_length=MAX_MESSAGES)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: Annotated[list[Includable], Meta(max_length=16)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] = 0
    # Echoed only: it bounds calls to built-in tools, and none run here.
    max_tool_calls: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    # Echoed only: every prompt shares the one prefix cache, keyed by its tokens.
    prompt_cache_key: Annotated[str, Meta(max_length=1024)] | None = None
    safety_identifier: Annotated[str, Meta(max_length=256)] | None = None
    service_tier: str | None = "auto"
    truncation: str | None = "disabled"
    prompt_cache_retention: str | None = None
    # vLLM's extensions, honoured as on chat (the request id also names the response: resp_<id>).
    seed: Int64 | None = None
    priority: Int64 = 0
    chat_template_kwargs: TemplateKwargs | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: CacheSalt | None = None
    request_id: RequestId | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    vllm_xargs: Any = None  # refused by chat (vllm_fields)
    # Refused (REFUSED_FIELDS).
    background: bool | None = False
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    previous_response: Any = None
    previous_input_messages: Any = None
    enable_response_messages: bool = False
    mm_processor_kwargs: Any = None
    context_management: Any = None
    prompt_cache_options: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None

    @property
    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def check_supported(self) -> None:
        """A 400 naming the first field set to what this server cannot honour."""
        for name, reason in REFUSED_FIELDS.items():
            if getattr(self, name) not in (None, False):
                raise APIError(400, f"{name} is not supported: {reason}", name)
        check_limited_fields(self, LIMITED_FIELDS)
        if "reasoning.encrypted_content" in (self.include or ()):
            raise APIError(400, "include reasoning.encrypted_content is not supported: earlier turns' reasoning "
                           "is never rendered back to the model (stored or not), so none is carried", "include")
        if self.top_logprobs and not self.output_logprobs:
            raise APIError(400, f"top_logprobs needs include [\"{OUTPUT_LOGPROBS}\"]", "top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    def new_messages(self) -> list[ChatMessage]:
        """This turn's input as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        if not self.input:
            raise APIError(400, "input must hold at least one item", "input")
        messages: list[ChatMessage] = []
        for index, item in enumerate(self.input):
            _append_item(messages, item, f"input[{index}]")
        return messages

    def chat_request(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat completion request this turn amounts to, after `history` (earlier turns)."""
        system = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        logprobs = self.output_logprobs
        return ChatCompletionRequest(
            messages=system + history + self.new_messages(), model=self.model,
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            stop=self.stop, ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, seed=self.seed, priority=self.priority,
            cache_salt=self.cache_salt, logprobs=logprobs, top_logprobs=self.top_logprobs if logprobs else None,
            tools=self._chat_tools(), tool_choice=self._tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(), structured_outputs=self.structured_outputs,
            reasoning_effort=None if self.reasoning is None else self.reasoning.effort,
            chat_template_kwargs=self.chat_template_kwargs, vllm_xargs=self.vllm_xargs)

    def _chat_tools(self) -> list[ChatTool] | None:
        if not self.tools:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.type != "function" or tool.name is None:
                raise APIError(400, f"tools[{index}]: only function tools (type \"function\" with a name) are "
                               f"served, not {tool.type!r}", "tools")
            tools.append(ChatTool(function=FunctionDefinition(name=tool.name, description=tool.description,
                                                              parameters=tool.parameters, strict=tool.strict)))
        return tools

    def _tool_choice(self):
        if isinstance(self.tool_choice, FunctionChoice):
            return NamedToolChoice(function=NamedFunction(name=self.tool_choice.name))
        return self.tool_choice

    def _response_format(self) -> ResponseFormat | None:
        fmt = None if self.text is None else self.text.format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", "text.format")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))


def _append_item(messages: list[ChatMessage], item: InputItem, where: str) -> None:
    if item.type == "message":
        if item.role is None:
            raise APIError(400, f"{where} is a message without a role", "input")
        messages.append(ChatMessage(role=item.role, content=_text(item.content, where)))
    elif item.type == "function_call":
        if item.name is None or item.arguments is None:
            raise APIError(400, f"{where}: a function_call item needs name and arguments", "input")
        call = ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls:
            last.tool_calls.append(call)  # parallel calls of one turn: one assistant message
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            raise APIError(400, f"{where}: a function_call_output item needs call_id and output", "input")
        messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    elif item.type != "reasoning":  # earlier reasoning is not replayed, as chat templates drop it
        raise APIError(400, f"{where} has type {item.type!r}; this server takes message, function_call, "
                       "function_call_output and reasoning items", "input")


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type not in _TEXT_PARTS or part.text is None:
            raise APIError(400, f"{where} holds a {part.type!r} part; this server takes text parts only", "input")
        texts.append(part.text)
    return "".join(texts)


# -- the response object -------------------------------------------------------------------------------

class OutputText(msgspec.Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    # With include message.output_text.logprobs: every generated token's, as chat's logprobs.
    logprobs: list[ChatLogprob] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True):
    type: str = "reasoning_text"
    text: str


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: str = "assistant"
    status: str = "completed"
    content: list[OutputText] = msgspec.field(default_factory=list)


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None
    status: str = "completed"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    model: str
    status: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    top_logprobs: int = 0
    truncation: str = "disabled"
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    usage: ResponseUsage | None = None


# -- stream events ---------------------------------------------------------------------------------------

class ResponseEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(ResponseEvent, kw_only=True, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(ResponseEvent, kw_only=True, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(ResponseEvent, kw_only=True, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(ResponseEvent, kw_only=True, tag="response.incomplete"):
    response: ResponseObject


class OutputItemAdded(ResponseEvent, kw_only=True, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, kw_only=True, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, kw_only=True, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class ContentPartDone(ResponseEvent, kw_only=True, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class OutputTextDelta(ResponseEvent, kw_only=True, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[ChatLogprob] = msgspec.field(default_factory=list)


class OutputTextDone(ResponseEvent, kw_only=True, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[ChatLogprob] = msgspec.field(default_factory=list)


class ReasoningTextDelta(ResponseEvent, kw_only=True, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDone(ResponseEvent, kw_only=True, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDelta(ResponseEvent, kw_only=True, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(ResponseEvent, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent, kw_only=True, tag="error"):
    code: str
    message: str
    param: str | None = None

"""Routes besides generation: models, tokenizer, health, load, version and Prometheus metrics."""
from __future__ import annotations

import corectl
from litestar import Controller, MediaType, Response, get, post, route
from litestar.enums import HttpMethod
from prometheus_client import CONTENT_TYPE_LATEST

from .auth import require_api_key
from .errors import APIError, error_response
from .protocol import DetokenizeRequest, TokenizeRequest, check_continuation, message_dicts
from .responses import (
    DetokenizeResponse,
    EngineLoad,
    LoadResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from .state import ServerState
from .tools import template_tools


# Litestar appends the charset to a text media type itself; prometheus_client's names one already.
_METRICS_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")


class ModelsController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @get("/models")
    async def list_models(self, server: ServerState) -> ModelList:
        return ModelList(_model_cards(server))

    @get("/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, server: ServerState) -> ModelCard:
        """OpenAI's `models.retrieve`: one served name or adapter (ids may hold slashes)."""
        model_id = model_id.removeprefix("/")
        card = next((card for card in _model_cards(server) if card.id == model_id), None)
        if card is None:
            raise APIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return card


def _model_cards(server: ServerState) -> list[ModelCard]:
    info = server.engine.info
    created = int(server.started_at)
    cards = [ModelCard(id=name, created=created, root=info.model_dir, max_model_len=info.max_model_len)
             for name in server.settings.served_model_names]
    adapters = [] if server.loras is None else server.loras.adapters()
    return cards + [ModelCard(id=lora.lora_name, created=created, root=lora.lora_path, parent=lora.base_model_name,
                              max_model_len=info.max_model_len) for lora in adapters]


class TokenizerController(Controller):
    guards = [require_api_key]
    tags = ["Tokenizer"]

    @post("/tokenize", status_code=200)
    async def tokenize(self, data: TokenizeRequest, server: ServerState) -> TokenizeResponse:
        server.check_model(data.model, adapters=True)
        if (data.prompt is None) == (data.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", "prompt")
        param = "prompt" if data.prompt is not None else "messages"
        tokenizer = server.require_tokenizer(param, "text cannot be tokenized; send token ids to /v1/completions")
        if data.prompt is not None:
            data.check_prompt_fields()
            tokens = tokenizer.encode(data.prompt, add_special_tokens=data.add_special_tokens is not False)
        else:
            check_continuation(data.messages, data.continue_final_message, data.add_generation_prompt)
            tools = template_tools(data.tools) if data.tools else None
            messages = message_dicts(data.messages)
            images = server.media.check(messages, server.engine.info)
            tokens = tokenizer.encode_chat(messages, add_generation_prompt=data.add_generation_prompt, tools=tools,
                                           template_kwargs=data.chat_template_kwargs,
                                           continue_final_message=data.continue_final_message,
                                           chat_template=data.chat_template,
                                           add_special_tokens=bool(data.add_special_tokens),
                                           content_format=server.settings.chat_template_content_format)
            # Each image counts as the placeholder tokens the model gives it.
            prompt = await server.media.prompt(images, tokens, server.engine.info, data.mm_processor_kwargs)
            tokens = prompt["prompt_token_ids"] if images else tokens
        strs = tokenizer.convert_ids_to_tokens(tokens) if data.return_token_strs else None
        return TokenizeResponse(len(tokens), server.engine.info.max_model_len, tokens, strs)

    @get("/tokenizer_info")
    async def tokenizer_info(self, server: ServerState) -> Response:
        """vLLM's /tokenizer_info (with --enable-tokenizer-info-endpoint): the tokenizer's configuration,
        chat template included."""
        if not server.settings.tokenizer_info:
            raise APIError(404, "GET /tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint")
        tokenizer = server.require_tokenizer("model", "there is no tokenizer to describe")
        return Response(tokenizer.info(), media_type=MediaType.JSON)

    @post("/detokenize", status_code=200)
    async def detokenize(self, data: DetokenizeRequest, server: ServerState) -> DetokenizeResponse:
        server.check_model(data.model, adapters=True)
        vocab = server.engine.info.vocab_size
        bad = [t for t in data.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", "tokens")
        tokenizer = server.require_tokenizer("tokens", "token ids cannot be turned into text")
        return DetokenizeResponse(tokenizer.decode(data.tokens))


class OpsController(Controller):
    """Open routes (no API key): what load balancers, supervisors and scrapers call."""

    tags = ["Operations"]

    @get("/health")
    async def health(self, server: ServerState) -> Response:
        return _health(server)

    @route("/ping", http_method=[HttpMethod.GET, HttpMethod.POST])
    async def ping(self, server: ServerState) -> Response:
        return _health(server)

    @get("/version")
    async def version(self) -> VersionResponse:
        return VersionResponse(corectl.__version__)

    @get("/metrics", media_type=MediaType.TEXT)
    async def metrics(self, server: ServerState) -> Response:
        body = server.metrics.render() if server.metrics is not None else b""
        return Response(body, media_type=_METRICS_TYPE)


class LoadController(Controller):
    guards = [require_api_key]
    tags = ["Operations"]

    @get("/load")
    async def load(self, server: ServerState) -> LoadResponse:
        client = server.engine
        stats = client.stats
        engines = [EngineLoad(str(index), s.num_running, s.num_waiting, s.kv_cache_usage)
                   for index, s in enumerate(client.engine_stats)]
        return LoadResponse(server.in_flight, stats.num_running, stats.num_waiting, stats.kv_cache_usage, engines)


def _health(server: ServerState) -> Response:
    ok, reason = server.healthy()
    if ok:
        return Response(b"", status_code=200)
    return error_response(503, reason)


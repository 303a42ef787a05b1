"""The offline API, modelled on vLLM's `LLM`: batch generation driven in-process."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from .config import EngineConfig
from .engine.core import EngineCore
from .engine.intake import NO_TOKENIZER, encode_prompt, prompt_mm_inputs
from .engine.output_processor import OutputProcessor
from .errors import InvalidRequestError
from .generation_config import check_generation_config, check_generation_overrides, generation_defaults
from .lora.request import LoRARequest
from .multimodal.chat import image_sources, local_image
from .multimodal.processing import ImageProcessing
from .multimodal.processors import image_processing_for
from .outputs import EmbeddingRequestOutput, RequestOutput
from .pooling import PoolingParams
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

# A prompt: text, token ids, or vLLM's dicts {"prompt": text} / {"prompt_token_ids": ids}.
PromptType = str | list[int] | dict


class LLM:
    """Generate from a model in this process.

        llm = LLM()                                   # embedded SmolLM2-135M-Instruct
        llm = LLM("path/to/hf_dir", dtype="float32")  # any EngineConfig option as a keyword
        llm = LLM("llama-tiny", load_format="dummy")  # a shape preset: token-id prompts, no text
        llm = LLM("Qwen/Qwen3-Embedding-0.6B")         # an embedding model: llm.embed(["text", ...])
        llm = LLM("path/to/hf_dir", enable_lora=True)  # then generate(..., lora_request=LoRARequest(...))

    `tokenizer` is None when the engine runs without one (see `EngineConfig.skip_tokenizer_init`).
    `generation_config` ("auto", "vllm" or a folder, as vLLM's) is where `generate` and `chat` called
    without sampling params take their defaults (`corectl.generation_config`);
    `override_generation_config` (vLLM's: the same keys) sets some of them over it.
    """

    def __init__(self, model: str | None = None, generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | str | None = None, **engine_args: Any):
        check_generation_config(generation_config)
        overrides = check_generation_overrides(override_generation_config)
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **engine_args))
        self._sampling_defaults = generation_defaults(generation_config, str(self.engine.source.model_dir), overrides)
        self.config = self.engine.config
        folder = self.engine.source.tokenizer_dir
        self.tokenizer = None if folder is None else Tokenizer.from_dir(folder, chat_template=self.config.chat_template)
        self._counter = itertools.count()
        self._loras: dict[int, LoRARequest] = {}  # adapters checked so far, by id
        self._image_processing: ImageProcessing | None = None  # a vision-language model's, once images come

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and move the weights to host memory (level 1) or drop them (level 2);
        needs `enable_sleep_mode=True`. Generation waits for `wake_up()`."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and the KV cache (or only the `tags` named: "weights", "kv_cache")."""
        self.engine.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`): the next prompts compute
        their prefixes again."""
        self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation-config defaults (vLLM's own without)."""
        return SamplingParams(**self._sampling_defaults)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{NO_TOKENIZER}, so there is no tokenizer to return")
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch; outputs come back in input order.

        A prompt is a string, a list of token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`; `sampling_params` is one for all or one per prompt (None: the
        model's defaults, `get_default_sampling_params`), and so is
        `lora_request` (the LoRA adapter to run with, None for the base model; needs enable_lora).
        `{"prompt_token_ids": ids, "mm_inputs": [...]}` carries processed images (`ImageProcessing.prompt`).
        """
        batch = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(batch), "sampling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, len(batch), "priority")
        loras = _broadcast(_as_list(lora_request), len(batch), "lora_request")
        encoded = [encode_prompt(self.tokenizer, p) for p in batch]
        return self._run(encoded, params, priorities, use_tqdm, loras, [prompt_mm_inputs(p) for p in batch])

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        As vLLM's `LLM.chat`: `tools` (OpenAI function specs) reach the template, `chat_template_kwargs`
        become template variables (e.g. `enable_thinking`), and `continue_final_message` leaves the
        last (assistant) message open for the model to continue instead of starting a new turn.
        A vision-language model reads image parts too: `{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}` or `{"type": "image_pil", "image_pil": <PIL.Image>}`;
        `mm_processor_kwargs` set its image processor's options for these images, over the engine's
        (Gemma 3: `{"do_pan_and_scan": True}`). `chat_template_content_format` is how message content
        reaches the template, as vLLM's: "auto", "string" or "openai" (`corectl.chat_content.CONTENT_FORMATS`)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message: pass "
                                      "add_generation_prompt=False with it", param="continue_final_message")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        sources_of = [image_sources(conv) for conv in conversations]
        if any(sources_of) and self.engine.info.image_token_id is None:
            raise InvalidRequestError(f"this model ({self.engine.info.architecture}) reads no images",
                                      param="messages", code="images_not_supported")
        prompts = [
            tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                          chat_template=chat_template, continue_final_message=continue_final_message,
                                          template_kwargs=chat_template_kwargs,
                                          content_format=chat_template_content_format)
            for conv in conversations
        ]
        params = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompts), "sampling_params")
        encoded = [(p, tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
        images = [self._chat_images(sources, ids, mm_processor_kwargs)
                  for sources, (_, ids) in zip(sources_of, encoded)]
        encoded = [(text, image["prompt_token_ids"]) if image else (text, ids)
                   for (text, ids), image in zip(encoded, images)]
        return self._run(encoded, params, [0] * len(prompts), use_tqdm,
                         mm_inputs=[image["mm_inputs"] if image else None for image in images])

    def _chat_images(self, sources: list, token_ids: list[int], processor_kwargs: dict[str, Any] | None) -> dict | None:
        """The engine prompt of a rendered conversation with these images; None without images."""
        if not sources:
            return None
        if self._image_processing is None:
            self._image_processing = image_processing_for(self.engine.source.model_dir, self.engine.source.hf_config,
                                                          self.config.mm_processor_kwargs)
        return self._image_processing.prompt(token_ids, [local_image(source) for source in sources],
                                             self._image_processing.options(processor_kwargs))

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best sequences of each prompt by
        cumulative logprob (`corectl.beam_search`); each sequence's `text` is the prompt's and its own."""
        if self.config.logprobs_mode.endswith("_logits"):
            raise InvalidRequestError(f"beam search ranks sequences by their logprobs, which this engine does not "
                                      f"report (logprobs_mode={self.config.logprobs_mode!r} reports logits)")
        encoded = [encode_prompt(self.tokenizer, p)[1] for p in _as_prompt_list(prompts)]
        decode = None if self.tokenizer is None else self.tokenizer.decode

        def generate(batch: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self._run([(None, ids) for ids in batch], [step] * len(batch), [0] * len(batch), use_tqdm)

        return run_beam_search(generate, encoded, params, self.engine.eos_token_id, decode)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a batch with a pooling model (`runner="pooling"`, or an embedding
        checkpoint); `outputs.embedding` of each result is its vector, in input order."""
        batch = _as_prompt_list(prompts)
        params = _broadcast(pooling_params or PoolingParams(), len(batch), "pooling_params")
        priorities = _broadcast(list(priority) if priority is not None else 0, len(batch), "priority")
        encoded = [encode_prompt(self.tokenizer, p) for p in batch]
        processor = self._processor()
        ids = [str(next(self._counter)) for _ in encoded]
        requests = [processor.add_pooling_request(rid, text, token_ids, p, prio)
                    for rid, (text, token_ids), p, prio in zip(ids, encoded, params, priorities)]
        return self._drive(processor, ids, requests, use_tqdm, "Embedding")

    def _processor(self) -> OutputProcessor:
        return OutputProcessor(self.engine.info, self.tokenizer, stream_deltas=False, final_only=True,
                               known_loras=self._loras)

    def _run(self, encoded, params, priorities, use_tqdm, loras=None, mm_inputs=None) -> list[RequestOutput]:
        processor = self._processor()
        ids = [str(next(self._counter)) for _ in encoded]
        loras = loras or [None] * len(encoded)
        mm_inputs = mm_inputs or [None] * len(encoded)
        requests = [
            core_request
            for rid, (text, token_ids), p, prio, lora, mm in zip(ids, encoded, params, priorities, loras, mm_inputs)
            for core_request in processor.add_request(rid, text, token_ids, p, prio, lora, mm)
        ]
        return self._drive(processor, ids, requests, use_tqdm, "Generating")

    def _drive(self, processor: OutputProcessor, ids: list[str], requests: list, use_tqdm: bool, desc: str) -> list:
        """Run registered requests to the end; their outputs in `ids` order. Intake has checked every
        prompt before any reaches the engine: a bad one refuses the whole batch."""
        self.engine.add_requests(requests)
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        # Stepping until the engine has nothing left (not merely until every output is in) also
        # completes a step still in flight under async scheduling: the engine is idle between calls.
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                outputs, to_abort = processor.process_outputs(self.engine.step().outputs)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_list(lora_request):
    """One adapter for every prompt stays one; a sequence of them (one per prompt) becomes a list."""
    return lora_request if lora_request is None or isinstance(lora_request, LoRARequest) else list(lora_request)


def _broadcast(value, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts", param=name)
        return value
    return [value] * count

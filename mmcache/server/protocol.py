"""Request and response bodies in OpenAI's shape (pydantic models): chat and completions, image generation,
speech.

Requests accept the fields OpenAI's clients send; fields this server does not act on are ignored, except those
whose meaning it cannot honour (``n`` above 1, ``logprobs``, ``echo``, ``best_of`` above 1), which are refused
by the handler with a 400 naming the field. Extensions, as vLLM names them: ``top_k``, ``cache_salt``,
``return_token_ids`` (the prompt's and the choice's token ids in the response), ``ignore_eos``.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

_MAX_TOKENS = Annotated[int, Field(ge=1)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class TextContent(_Lenient):
    type: Literal["text"]
    text: str


class ImageContent(_Lenient):
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]


ContentPart = Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # an assistant answer exactly as generated


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    max_tokens: _MAX_TOKENS | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Union[str, list[str], None] = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: _MAX_TOKENS | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[Annotated[int, Field(ge=0)]], list[list[Annotated[int, Field(ge=0)]]]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ImageGenerationRequest(_Lenient):
    """``POST /v1/images/generations``. ``model`` may be left out (this server's image model); ``size`` "WxH"
    (default: the first configured size); ``seed`` (extension, as vLLM-Omni's): the same seed, the same images."""

    prompt: Annotated[str, Field(min_length=1)]
    model: str | None = None
    negative_prompt: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    size: str | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    guidance_scale: float | None = None
    num_inference_steps: Annotated[int, Field(ge=1)] | None = None
    response_format: str | None = None  # "b64_json" (the default here); "url" is refused: no file is stored
    output_format: str | None = None  # "png" only
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    cache_salt: str | None = None
    user: str | None = None


class SpeechRequest(_Lenient):
    """``POST /v1/audio/speech``: ``input`` spoken in the voice of ``ref_audio`` (a data URL or base64 of a WAV,
    FLAC or OGG file) whose transcript is ``ref_text``. ``voice`` is accepted (OpenAI's clients send it) and not
    used: the voice is the reference clip's. Extensions: ``ref_audio``, ``ref_text``, ``seed``, ``temperature``
    (None: the model's generation config; 0: greedy; above: sampling) and ``max_new_tokens`` (audio frames).
    Numbers are JSON numbers of their type (no strings, no booleans), finite and within range: ``speed`` in
    OpenAI's [0.25, 4], ``temperature`` in [0, 2], ``seed`` in [0, 2**63), ``max_new_tokens`` at least 1 (the
    handler bounds it and ``speed`` further)."""

    model: str
    input: Annotated[str, Field(min_length=1)]
    voice: str | None = None
    ref_audio: str | None = None
    ref_text: str = ""
    response_format: str = "wav"
    speed: Annotated[float, Field(strict=True, ge=0.25, le=4.0, allow_inf_nan=False)] | None = None
    instructions: str | None = None
    stream_format: str | None = None
    seed: Annotated[int, Field(strict=True, ge=0, lt=2**63)] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    max_new_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    cache_salt: str | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def now() -> int:
    return int(time.time())


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "mmcache", "root": name,
            "max_model_len": max_model_len}

"""OpenAI requests -> engine requests: chat messages rendered for the served model, images checked, sampling
settings mapped.

Rules:

* Images come only as data URLs. An ``http(s)`` URL is refused with a 400 saying this server fetches nothing; a
  path or ``file://`` URL is refused too and never read (the VLM's ``ImageLimits`` forbid paths as well). A data
  URL whose payload is beyond ``max_image_bytes`` is refused with 413 before it is decoded.
* A text model renders chat messages with the ``chat_template`` file of the config (``--chat-template``), else
  with its tokenizer's own chat template, through ``encoders.jinja_template.JinjaChatTemplate``: an assistant
  message carrying ``token_ids`` (the answer as generated) keeps them verbatim, so a chat's next turn begins with
  the previous prompt plus its answer and reuses its pages, and user text yields no special token. A template
  that breaks that rule (``JinjaChatTemplate``'s probe) is rendered by transformers' ``apply_chat_template``
  instead, and a log line says why. The embedded text presets have no template, so they use
  ``PlainChatTemplate``: each message as ``"{role}:"`` then ``" {text}"`` then ``"\\n"``, each segment tokenized
  on its own, and ``"assistant:"`` as the generation prompt.
* Sampling settings a request leaves unset take the served folder's ``generation_config.json`` values, as vLLM's
  default ``--generation-config auto`` does (``generation_defaults``): ``temperature``, ``top_p``, ``top_k`` and
  ``max_new_tokens`` (for ``max_tokens``); a request's own values always win, and without the file OpenAI's
  defaults hold. The folder's penalties and ``min_p`` are not applied (the engine has none; a log line says so).
* A VLM renders them with the preset's chat template (``encoders.chat``); ``developer`` is read as ``system``.
* Work is bounded before it is done: a prompt's text (every message's text, or a completion's prompt) longer
  than ``max_chars`` characters is refused (400 ``context_length_exceeded``) before any tokenizer sees it. The
  default bound is ``max_model_len`` times (the longest vocabulary entry's characters + 1): a text that long
  needs more than ``max_model_len`` tokens under any tokenizer whose tokens each cover at most one entry and one
  separator, so only prompts the engine would refuse anyway are refused (a pre-tokenizer that drops runs of
  whitespace is the exception: ``max_prompt_chars`` sets the bound by hand). Each stop string is at most
  ``max_stop_chars`` characters.
* Threads: a Hugging Face fast tokenizer refuses to encode on one thread while another uses it ("Already
  borrowed"), and encoding a long text would hold the event loop. Requests are therefore built on the
  server's one prompt thread (``build``), on its own copy of the engine's tokenizer: it renders chats and
  tokenizes text prompts there (as the engine's intake would: no special tokens added). Outputs are decoded
  on the event loop's thread with a second copy (``PromptMaker.tokenizer``); the engine's own tokenizer is
  left to the step thread. A VLM's chat template tokenizes in the worker threads that build its prompts, on
  the template's own ``tokenizers.Tokenizer`` whose settings never change after it is made, so those encodes
  only read it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..engine.request import Request, SamplingParams
from ..errors import InvalidRequest
from .errors import bad_request, too_large
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ImageContent, TextContent


log = logging.getLogger(__name__)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "max_tokens")
"""The settings a folder's generation_config.json gives to requests that leave them unset (vLLM's mapping, less
the penalties and min_p, which the engine does not have)."""
_NOT_APPLIED = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")


def sampling_of(req, default_max_tokens: int, defaults: dict | None = None) -> SamplingParams:
    """The engine's sampling settings of a chat or completion request; ``defaults`` (``generation_defaults``)
    fill the fields the request left unset."""
    defaults = defaults or {}
    given = req.model_fields_set

    def pick(name: str):
        return getattr(req, name) if name in given or name not in defaults else defaults[name]

    max_tokens = (getattr(req, "max_completion_tokens", None) or req.max_tokens or defaults.get("max_tokens")
                  or default_max_tokens)
    return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature"), top_k=max(0, pick("top_k")),
                          top_p=pick("top_p"), seed=req.seed, ignore_eos=req.ignore_eos)


def generation_defaults(folder) -> dict:
    """The sampling defaults in ``folder``'s generation_config.json, read as vLLM reads them (transformers'
    ``GenerationConfig``, the values it holds beyond its own defaults): ``temperature``, ``top_p``, ``top_k`` and
    ``max_tokens`` (from ``max_new_tokens``). Empty without a folder or a readable file."""
    from transformers import GenerationConfig

    if folder is None or not (Path(folder) / "generation_config.json").is_file():
        return {}
    try:
        given = GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    except (OSError, ValueError) as e:
        log.warning("%s: generation_config.json is not read (%s); OpenAI's sampling defaults apply", folder, e)
        return {}
    if "max_new_tokens" in given:
        given["max_tokens"] = given.pop("max_new_tokens")
    ignored = [name for name in _NOT_APPLIED if given.get(name) is not None]
    if ignored:
        log.warning("%s: generation_config.json sets %s, which this server does not apply", folder,
                    ", ".join(ignored))
    ranges = {"temperature": lambda v: isinstance(v, (int, float)) and 0 <= v <= 2,
              "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
              "top_k": lambda v: isinstance(v, int) and v >= -1,
              "max_tokens": lambda v: isinstance(v, int) and v >= 1}
    out = {}
    for name in SAMPLING_DEFAULTS:
        value = given.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not ranges[name](value):
            log.warning("%s: generation_config.json's %s of %r is out of range and not used", folder, name, value)
            continue
        out[name] = value
    return out


def stop_strings(req, max_chars: int) -> list[str]:
    """The request's stop strings: at most 8, each non-empty and at most ``max_chars`` characters."""
    stop = req.stop
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 8 or any(not s for s in stops):
        raise bad_request("stop must be at most 8 non-empty strings", "stop")
    if any(len(s) > max_chars for s in stops):
        raise bad_request(f"each stop string must be at most {max_chars} characters", "stop")
    return stops


def prompt_char_bound(tokenizer, max_model_len: int) -> int:
    """The default bound on a prompt's characters (module docstring)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    longest = max((len(entry) for entry in vocab), default=1)
    return max_model_len * (longest + 1)


def prompt_chars(req) -> int:
    """Characters of text in a chat's messages or a completion's prompt (token ids and images not counted)."""
    if isinstance(req, ChatCompletionRequest):
        total = 0
        for m in req.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(p.text) for p in m.content if isinstance(p, TextContent))
        return total
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def check_supported(req) -> None:
    """Refuse what this server cannot honour, naming the field."""
    if req.n != 1:
        raise bad_request("n > 1 is not supported: ask for one choice per request", "n", "unsupported")
    if req.logprobs not in (None, False, 0):
        raise bad_request("logprobs are not supported", "logprobs", "unsupported")
    if getattr(req, "echo", False):
        raise bad_request("echo is not supported", "echo", "unsupported")
    if (getattr(req, "best_of", None) or 1) != 1:
        raise bad_request("best_of > 1 is not supported", "best_of", "unsupported")
    if getattr(req, "suffix", None):
        raise bad_request("suffix is not supported", "suffix", "unsupported")


class PlainChatTemplate:
    """Chat messages as plain ``role: text`` lines for a tokenizer without a chat template (see the module
    docstring); each segment is tokenized on its own so earlier turns' ids never change."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def render(self, messages: list[tuple[str, str, list[int] | None]]) -> list[int]:
        ids: list[int] = []
        for role, text, token_ids in messages:
            ids += self._ids(f"{role}:")
            ids += list(token_ids) if token_ids is not None else self._ids(" " + text)
            ids += self._ids("\n")
        return ids + self._ids("assistant:")


class PromptMaker:
    """Builds the engine request of an API request for one host (text ``Engine`` or ``VLMEngine``)."""

    def __init__(self, host, config):
        self.host = host
        self.config = config
        #: the server's copy of the engine's tokenizer for decoding, on the event loop's thread only
        self.tokenizer = copy.deepcopy(host.core.tokenizer)
        #: the copy that encodes, on the prompt thread only (module docstring)
        self.encoder = encoder = copy.deepcopy(host.core.tokenizer)
        self.hf_template = self.jinja = None
        if encoder is not None and not host.is_vlm:
            self.hf_template, self.jinja = _text_template(encoder, config)
        self.plain = PlainChatTemplate(encoder) if encoder is not None else None
        #: sampling settings for what requests leave unset (``generation_defaults``)
        self.defaults = generation_defaults(getattr(config, "model", None))
        self.max_chars = config.max_prompt_chars or prompt_char_bound(encoder, host.core.max_model_len)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmcache-prompts")

    def check_length(self, req) -> None:
        """400 ``context_length_exceeded`` when ``req``'s text is beyond ``max_chars`` (module docstring)."""
        chars = prompt_chars(req)
        if chars > self.max_chars:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise bad_request(f"the prompt's text is {chars} characters, beyond the {self.max_chars} that "
                              f"{self.host.core.max_model_len} tokens of this model can hold",
                              param, "context_length_exceeded")

    async def build(self, make, req, *args):
        """``make(req, *args)`` (``chat`` or ``completion``) on the prompt thread; ``check_length`` first."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, make, req, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ---- chat --------------------------------------------------------------------------------------
    def chat(self, req: ChatCompletionRequest, rid: str, salt: bytes, arrival: float):
        sampling = sampling_of(req, self.config.default_max_tokens, self.defaults)
        if self.host.is_vlm:
            from ..hosts.vlm import VLMRequest

            messages = [self._vlm_message(i, m) for i, m in enumerate(req.messages)]
            self._count_images(messages)
            return VLMRequest(messages=messages, sampling=sampling, request_id=rid, salt=salt)
        return Request(self._text_prompt(req.messages), sampling, rid, salt, arrival_time=arrival)

    def _vlm_message(self, i: int, message: ChatMessage) -> dict:
        role = "system" if message.role == "developer" else message.role
        out: dict = {"role": role}
        if isinstance(message.content, list):
            parts = []
            for j, part in enumerate(message.content):
                if isinstance(part, TextContent):
                    parts.append({"type": "text", "text": part.text})
                else:
                    parts.append({"type": "image_url", "image_url": {"url": self._image_url(i, j, part)}})
            out["content"] = parts
        else:
            out["content"] = message.content
        if message.token_ids is not None:
            out["token_ids"] = message.token_ids
        return out

    def _count_images(self, messages: list[dict]) -> None:
        n = sum(1 for m in messages if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url")
        if n > self.config.max_images:
            raise bad_request(f"{n} images in the messages; at most {self.config.max_images} per request", "messages")

    def _image_url(self, i: int, j: int, part: ImageContent) -> str:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        param = f"messages.{i}.content.{j}.image_url"
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in ("http", "https"):
            raise bad_request("image URLs are not fetched by this server: send the image as a data URL "
                              "(data:image/png;base64,...)", param, "invalid_image_url")
        if scheme != "data":
            raise bad_request("images must be data URLs (data:image/png;base64,...); paths and file URLs are "
                              "never read", param, "invalid_image_url")
        comma = url.find(",")
        payload = len(url) - comma - 1 if comma >= 0 else 0
        # base64 carries 3 bytes per 4 characters; percent-encoding at least 1 byte per 3 characters
        size = payload * 3 // 4 if url[:comma].lower().endswith(";base64") else payload // 3
        if size > self.config.max_image_bytes:
            raise too_large(f"image payload of about {size} bytes is beyond the limit of "
                            f"{self.config.max_image_bytes}", param)
        return url

    def _text_prompt(self, messages: list[ChatMessage]) -> list[int]:
        if self.plain is None:
            raise bad_request("this model has no tokenizer: use /v1/completions with token ids", "messages")
        flat: list[tuple[str, str, list[int] | None]] = []
        for i, m in enumerate(messages):
            if isinstance(m.content, list):
                if any(isinstance(p, ImageContent) for p in m.content):
                    raise bad_request(f"model {self.config.model_name!r} does not accept images",
                                      f"messages.{i}.content", "invalid_image")
                text = "".join(p.text for p in m.content)
            else:
                text = m.content or ""
            if m.token_ids is not None and m.role != "assistant":
                raise bad_request("token_ids are accepted on assistant messages only", f"messages.{i}.token_ids")
            role = "system" if m.role == "developer" else m.role
            flat.append((role, text, m.token_ids))
        if self.jinja is not None:
            return self._jinja_render(flat)
        if self.hf_template:
            return self._hf_render(flat)
        return self.plain.render(flat)

    def _jinja_render(self, flat) -> list[int]:
        from encoders.chat_template import Message, TextPart

        messages = [Message(role, (TextPart(text),), None if ids is None else tuple(ids)) for role, text, ids in flat]
        try:
            return self.jinja.render(messages, [], True)[0]
        except InvalidRequest as e:  # a template that refuses these messages (roles out of order, ...)
            raise bad_request(str(e), "messages") from None

    def _hf_render(self, flat) -> list[int]:
        tok = self.encoder
        messages = [{"role": role, "content": text} for role, text, _ in flat]
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                          chat_template=self.hf_template)
        except Exception as e:  # a template that refuses these messages (roles out of order, ...)
            raise bad_request(f"the model's chat template refused the messages: {e}", "messages") from None
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    # ---- completions -------------------------------------------------------------------------------
    def completion(self, req: CompletionRequest, rid: str, salt: bytes, arrival: float):
        sampling = sampling_of(req, self.config.default_max_tokens, self.defaults)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("one prompt per request (a list of prompts is not supported)", "prompt",
                                  "unsupported")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt or prompt == "":
            raise bad_request("the prompt is empty", "prompt")
        if self.host.is_vlm:
            from ..hosts.vlm import VLMRequest

            ids = self.host.engine.builder.template.text(prompt) if isinstance(prompt, str) else prompt
            return VLMRequest(token_ids=ids, sampling=sampling, request_id=rid, salt=salt)
        if isinstance(prompt, str):
            if self.encoder is None:
                raise bad_request("this model has no tokenizer: give the prompt as token ids", "prompt")
            prompt = self.encoder(prompt, add_special_tokens=False)["input_ids"]
        return Request(prompt, sampling, rid, salt, arrival_time=arrival)


def _text_template(encoder, config) -> tuple[str | None, object]:
    """A text model's chat template source (the config's file, else the tokenizer's own; None: none) and its
    ``JinjaChatTemplate``, None where the tokenizer is not a fast one or the template fails the probe (module
    docstring)."""
    from encoders.jinja_template import ChatTemplateError, JinjaChatTemplate, read_template_file

    path = getattr(config, "chat_template", None)
    source = read_template_file(path) if path else getattr(encoder, "chat_template", None)
    if not isinstance(source, str) or not source:
        return None, None
    backend = getattr(encoder, "backend_tokenizer", None)
    if backend is None:
        return source, None
    specials = {k: v for k, v in getattr(encoder, "special_tokens_map", {}).items() if isinstance(v, str)}
    try:
        return source, JinjaChatTemplate(backend, source, None, specials)
    except (ChatTemplateError, InvalidRequest) as e:
        log.warning("the chat template%s keeps no page reuse across turns, so apply_chat_template renders it: %s",
                    f" of {path}" if path else "", e)
        return source, None

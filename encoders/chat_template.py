"""Chat templates rendered straight to token ids, one segment at a time, for the LLaVA and Qwen2-VL presets.

A message renders as ``header(role) + body + footer(role)``; the generation prompt is ``header("assistant")``.
Text is tokenized per segment (never across a segment boundary), special tokens are inserted as ids, and user
text can never produce a special token (it is tokenized with special-token parsing off). An assistant message
may carry the ``token_ids`` the model generated; they are used verbatim as its body, and the end-of-turn token
is appended only if they do not already end with it.

Invariant (the prefix property that lets a chat's KV pages be reused across turns): for messages ``m`` and an
answer ``a`` generated from ``render(m, add_generation_prompt=True)``,
``render(m + [assistant(token_ids=a)] + later, True)`` begins with ``render(m, True) + a``.

``LlavaTemplate`` (Vicuna v1, the llava-1.5 conversation format)::

    <s>{system} USER: <image>*n\\n{text} ASSISTANT:{answer}</s>USER: {text} ASSISTANT:

``ChatMLTemplate`` (Qwen2-VL; no default system message is added)::

    <|im_start|>user\\n<|vision_start|><|image_pad|>*n<|vision_end|>{text}<|im_end|>\\n<|im_start|>assistant\\n
    {answer}<|im_end|>\\n

Image parts render where they appear among a message's parts; ``ImageRun.start`` is the position of an image's
first placeholder token (the position a ``MediaItem`` records).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer

from mmcache.errors import InvalidRequest

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image in a message; ``index`` is its position among the request's images (request order)."""

    index: int


@dataclass(frozen=True)
class Message:
    role: str
    parts: tuple[TextPart | ImagePart, ...]
    token_ids: tuple[int, ...] | None = None  # assistant only: the answer exactly as generated


@dataclass(frozen=True)
class ImageRun:
    """Where one image's placeholder tokens lie in a rendered prompt."""

    index: int  # the image's index in the request
    start: int  # position of its first placeholder token
    length: int


class ChatTemplate(ABC):
    """Renders messages to token ids with image placeholder runs of given lengths."""

    def __init__(self, tokenizer: Tokenizer, image_token: str):
        # A private copy so turning special-token parsing off cannot affect the caller's tokenizer.
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.image_token_id = self.special(image_token)

    def special(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise InvalidRequest(f"the tokenizer has no token {token!r}, which the chat template needs")
        return token_id

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    @property
    @abstractmethod
    def end_of_turn_id(self) -> int:
        """The token an assistant turn ends with (generation stops at it)."""

    @abstractmethod
    def start(self) -> list[int]:
        """Ids that open every conversation."""

    @abstractmethod
    def header(self, role: str) -> list[int]:
        """Ids before a message body; ``header("assistant")`` is the generation prompt."""

    @abstractmethod
    def footer(self, role: str) -> list[int]:
        """Ids after a message body (for the assistant, after the end-of-turn token)."""

    @abstractmethod
    def image_run(self, n: int) -> tuple[list[int], int]:
        """Ids for an image with ``n`` placeholders and the offset of the first placeholder in them."""

    @abstractmethod
    def assistant_text(self, text: str) -> list[int]:
        """Body ids for an assistant answer given as text rather than as generated ids."""

    def render(self, messages: Sequence[Message], placeholders: Sequence[int],
               add_generation_prompt: bool = True) -> tuple[list[int], list[ImageRun]]:
        """Token ids of ``messages`` and the image runs, image ``i`` getting ``placeholders[i]`` tokens."""
        ids = self.start()
        runs: list[ImageRun] = []
        for message in messages:
            ids += self.header(message.role)
            if message.role == "assistant":
                body = list(message.token_ids) if message.token_ids is not None else self.assistant_text(
                    "".join(p.text for p in message.parts))
                ids += body
                if not body or body[-1] != self.end_of_turn_id:
                    ids.append(self.end_of_turn_id)
            else:
                for part in message.parts:
                    if isinstance(part, TextPart):
                        ids += self.text(part.text)
                    else:
                        run, offset = self.image_run(placeholders[part.index])
                        runs.append(ImageRun(part.index, len(ids) + offset, placeholders[part.index]))
                        ids += run
            ids += self.footer(message.role)
        if add_generation_prompt:
            ids += self.header("assistant")
        return ids, runs


class LlavaTemplate(ChatTemplate):
    """Vicuna v1 turns as llava-1.5 uses them; images render as ``<image>*n`` followed by a newline."""

    def __init__(self, tokenizer: Tokenizer, image_token: str = "<image>", bos: str = "<s>", eos: str = "</s>"):
        super().__init__(tokenizer, image_token)
        self.bos_id = self.special(bos)
        self.eos_id = self.special(eos)
        self._newline = self.text("\n")
        self._user = self.text("USER: ")
        self._assistant = self.text("ASSISTANT:")
        self._space = self.text(" ")

    @property
    def end_of_turn_id(self) -> int:
        return self.eos_id

    def start(self) -> list[int]:
        return [self.bos_id]

    def header(self, role: str) -> list[int]:
        return {"system": [], "user": self._user, "assistant": self._assistant}[role]

    def footer(self, role: str) -> list[int]:
        return {"system": self._space, "user": self._space, "assistant": []}[role]

    def image_run(self, n: int) -> tuple[list[int], int]:
        return [self.image_token_id] * n + self._newline, 0

    def assistant_text(self, text: str) -> list[int]:
        return self.text(" " + text)


class ChatMLTemplate(ChatTemplate):
    """ChatML turns as Qwen2-VL uses them; images render as ``<|vision_start|><|image_pad|>*n<|vision_end|>``."""

    def __init__(self, tokenizer: Tokenizer, image_token: str = "<|image_pad|>"):
        super().__init__(tokenizer, image_token)
        self.im_start_id = self.special("<|im_start|>")
        self.im_end_id = self.special("<|im_end|>")
        self.vision_start_id = self.special("<|vision_start|>")
        self.vision_end_id = self.special("<|vision_end|>")
        self._role = {role: self.text(role + "\n") for role in ROLES}
        self._newline = self.text("\n")

    @property
    def end_of_turn_id(self) -> int:
        return self.im_end_id

    def start(self) -> list[int]:
        return []

    def header(self, role: str) -> list[int]:
        return [self.im_start_id] + self._role[role]

    def footer(self, role: str) -> list[int]:
        return self._newline if role == "assistant" else [self.im_end_id] + self._newline

    def image_run(self, n: int) -> tuple[list[int], int]:
        return [self.vision_start_id] + [self.image_token_id] * n + [self.vision_end_id], 1

    def assistant_text(self, text: str) -> list[int]:
        return self.text(text)

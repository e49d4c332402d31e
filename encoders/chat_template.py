"""Chat templates rendered straight to token ids: ``ChatTemplate`` (what a ``PromptBuilder`` renders with) and
``TurnTemplate``, whose turns are fixed segments, for the LLaVA and Qwen2-VL presets (``jinja_template`` renders a
model folder's own Jinja template under the same contract).

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

``render`` refuses malformed input with ``InvalidRequest`` (``chat.parse_messages`` builds valid messages; the
checks here are the cheap ones that keep a direct caller from getting garbage ids): roles in ``ROLES``, text
parts of Unicode text, images only in user messages with each of the ``placeholders`` used exactly once and
each count a positive int, ``token_ids`` only on assistant messages and inside the vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer

from mmcache.checks import positive_int, unicode_text
from mmcache.errors import InvalidRequest
from mmcache.names import as_token_array

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


def _check_role(role: object) -> None:
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"role {role!r} is not one of {ROLES}")


def _check_text(text: object) -> None:
    if not unicode_text(text):
        raise InvalidRequest(f"text must be a str of Unicode text, got {type(text).__name__}"
                             + (" holding a lone surrogate" if isinstance(text, str) else ""))


def _check_count(n: object) -> None:
    if not positive_int(n):
        raise InvalidRequest(f"an image's placeholder count must be an int >= 1, got {n!r}")


class ChatTemplate(ABC):
    """Renders messages to token ids with image placeholder runs of given lengths (the prefix property of the
    module docstring holds for every subclass)."""

    def __init__(self, tokenizer: Tokenizer, image_token: str | None):
        if not isinstance(tokenizer, Tokenizer):
            raise InvalidRequest(f"a chat template needs a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        # A private copy so turning special-token parsing off cannot affect the caller's tokenizer.
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        #: the image placeholder's id; None for a text model's template, which refuses images
        self.image_token_id = None if image_token is None else self.special(image_token)

    def special(self, token: str) -> int:
        if not isinstance(token, str):
            raise InvalidRequest(f"a special token must be a str, got {type(token).__name__}")
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise InvalidRequest(f"the tokenizer has no token {token!r}, which the chat template needs")
        return token_id

    def text(self, text: str) -> list[int]:
        _check_text(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    @property
    @abstractmethod
    def end_of_turn_id(self) -> int:
        """The token an assistant turn ends with (generation stops at it)."""

    @abstractmethod
    def render(self, messages: Sequence[Message], placeholders: Sequence[int],
               add_generation_prompt: bool = True) -> tuple[list[int], list[ImageRun]]:
        """Token ids of ``messages`` and the image runs, image ``i`` getting ``placeholders[i]`` tokens.

        ``InvalidRequest`` for malformed input (the module docstring lists the checks)."""

    @staticmethod
    def check_arguments(messages: object, placeholders: object, add_generation_prompt: object) -> None:
        """``InvalidRequest`` unless ``render``'s arguments are of their types."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequest(f"messages must be a list of Message, got {type(messages).__name__}")
        if not isinstance(placeholders, (list, tuple)) or not all(positive_int(n) for n in placeholders):
            raise InvalidRequest("placeholders must be a list of positive ints, one per image")
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequest(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")

    def check_message(self, i: int, message: object) -> None:
        """``InvalidRequest`` unless message ``i`` is well formed for this template."""
        if not isinstance(message, Message):
            raise InvalidRequest(f"message {i} is {type(message).__name__}, not a Message")
        _check_role(message.role)
        if not isinstance(message.parts, (list, tuple)):
            raise InvalidRequest(f"message {i}: parts must be a tuple of TextPart and ImagePart")
        for part in message.parts:
            if isinstance(part, ImagePart) and message.role != "user":
                raise InvalidRequest(f"message {i}: images are accepted in user messages only, not {message.role}")
            if isinstance(part, ImagePart) and self.image_token_id is None:
                raise InvalidRequest(f"message {i}: this model does not accept images")
            if not isinstance(part, (TextPart, ImagePart)):
                raise InvalidRequest(f"message {i}: a part is {type(part).__name__}, not a TextPart or ImagePart")
            if isinstance(part, TextPart):
                _check_text(part.text)
        if message.token_ids is not None and message.role != "assistant":
            raise InvalidRequest(f"message {i}: token_ids are accepted on assistant messages only")

    def answer_ids(self, i: int, message: Message) -> list[int]:
        """Assistant message ``i``'s generated ids, checked against the vocabulary."""
        ids = as_token_array(message.token_ids)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise InvalidRequest(f"message {i}: token_ids hold id {int(ids.max())} outside the vocabulary of "
                                 f"{self.vocab_size}")
        return ids.tolist()

    @staticmethod
    def check_image(i: int, part: ImagePart, seen: list[int], placeholders: Sequence[int]) -> None:
        """``InvalidRequest`` unless image ``part`` of message ``i`` has a placeholder count and was not ``seen``."""
        index = part.index
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(placeholders):
            raise InvalidRequest(f"message {i}: image index {index!r} has no placeholder count "
                                 f"({len(placeholders)} given)")
        if index in seen:
            raise InvalidRequest(f"message {i}: image {index} appears twice")


class TurnTemplate(ChatTemplate):
    """A template whose messages render as ``header(role) + body + footer(role)`` (the module docstring)."""

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
        self.check_arguments(messages, placeholders, add_generation_prompt)
        ids = self.start()
        runs: list[ImageRun] = []
        for i, message in enumerate(messages):
            self.check_message(i, message)
            ids += self.header(message.role)
            if message.role == "assistant":
                body = self._answer(i, message)
                ids += body
                if not body or body[-1] != self.end_of_turn_id:
                    ids.append(self.end_of_turn_id)
            else:
                for part in message.parts:
                    if isinstance(part, TextPart):
                        ids += self.text(part.text)
                    else:
                        self.check_image(i, part, [run.index for run in runs], placeholders)
                        run, offset = self.image_run(placeholders[part.index])
                        runs.append(ImageRun(part.index, len(ids) + offset, placeholders[part.index]))
                        ids += run
            ids += self.footer(message.role)
        if len(runs) != len(placeholders):
            raise InvalidRequest(f"placeholders for {len(placeholders)} image(s), but the messages hold "
                                 f"{len(runs)} image part(s)")
        if add_generation_prompt:
            ids += self.header("assistant")
        return ids, runs

    def _answer(self, i: int, message: Message) -> list[int]:
        """An assistant message's body: its generated ids verbatim, else its text tokenized as an answer."""
        if message.token_ids is None:
            return self.assistant_text("".join(p.text for p in message.parts))
        return self.answer_ids(i, message)


class LlavaTemplate(TurnTemplate):
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
        _check_role(role)
        return {"system": [], "user": self._user, "assistant": self._assistant}[role]

    def footer(self, role: str) -> list[int]:
        _check_role(role)
        return {"system": self._space, "user": self._space, "assistant": []}[role]

    def image_run(self, n: int) -> tuple[list[int], int]:
        _check_count(n)
        return [self.image_token_id] * n + self._newline, 0

    def assistant_text(self, text: str) -> list[int]:
        _check_text(text)
        return self.text(" " + text)


class ChatMLTemplate(TurnTemplate):
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
        _check_role(role)
        return [self.im_start_id] + self._role[role]

    def footer(self, role: str) -> list[int]:
        _check_role(role)
        return self._newline if role == "assistant" else [self.im_end_id] + self._newline

    def image_run(self, n: int) -> tuple[list[int], int]:
        _check_count(n)
        return [self.vision_start_id] + [self.image_token_id] * n + [self.vision_end_id], 1

    def assistant_text(self, text: str) -> list[int]:
        return self.text(text)

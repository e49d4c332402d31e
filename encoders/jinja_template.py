"""A chat template from Jinja source (a model folder's own, or a file given with ``--chat-template``), rendered to
token ids and image runs as ``chat_template.ChatTemplate`` renders them.

How: the messages go through transformers' Jinja renderer (the sandbox and helpers of ``apply_chat_template``,
which vLLM renders with too), each text part and each assistant answer given as token ids replaced by a
sentinel string, each image as a ``{"type": "image"}`` part whose token the template writes itself. The rendered
text is cut at the answers' sentinels into pieces; each piece, its texts put back, is tokenized whole (special
tokens parsed, as vLLM tokenizes a rendered prompt), each answer's ids go in verbatim between the pieces, and
each image token becomes its run of placeholders. A first turn's ids are therefore those of a whole-text
tokenization of the rendered prompt with each image token expanded.

Rules:

* User text never yields a special token: a piece in which a special token overlaps a text's characters is
  tokenized part by part instead, the texts with special-token parsing off (its ids then differ from a
  whole-text tokenization at those boundaries).
* The content format is vLLM's: a template that loops over a message's ``content`` gets content as a list of
  parts (``openai``), any other a string, the texts of a message joined by newlines (``string``; such a template
  has no place for images, so a VLM's is refused).
* The template's image tokens, in order, are the request's images in message order; a render with more or
  fewer is refused. A text sentinel may appear any number of times; an answer's exactly once.
* An answer's ids are its body verbatim; when they end with the end-of-turn token and the template writes that
  token right after the answer, it is written once.
* ``JinjaChatTemplate`` renders a probe chat of three turns with images when it is made, and refuses
  (``ChatTemplateError``) a template that does not compile, raises, drops or repeats an image or an answer, or
  breaks the prefix property of ``chat_template``: each turn's prompt must begin with the previous turn's
  prompt plus its answer.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from tokenizers import Tokenizer

from mmcache.errors import InvalidRequest, MmcacheError

from .chat_template import ChatTemplate, ImagePart, ImageRun, Message, TextPart

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a sentinel's number
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
"""Where a folder's chat template is looked for, in this order (transformers' own order)."""


class ChatTemplateError(MmcacheError, ValueError):
    """A chat template cannot be used: unreadable, not UTF-8, not Jinja, or it breaks a rule of the module
    docstring on the probe chat."""


def read_template_file(path) -> str:
    """The Jinja source in ``path`` (a ``.jinja`` file, or a JSON file with a ``chat_template`` string, as
    chat_template.json holds it); ``ChatTemplateError`` when it cannot be read or decoded."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ChatTemplateError(f"cannot read the chat template {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"the chat template {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".json":
        return _from_json(text, path)
    if not text.strip():
        raise ChatTemplateError(f"the chat template {path} is empty")
    return text


def _from_json(text: str, path: Path) -> str | None:
    try:
        value = json.loads(text).get("chat_template")
    except (ValueError, AttributeError):
        raise ChatTemplateError(f"{path} is not a JSON object") from None
    if isinstance(value, list):  # named templates (tokenizer_config.json): the default one
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"the chat_template in {path} is not a string")
    return value


def folder_template(folder) -> tuple[str, Path] | None:
    """The Jinja source of ``folder``'s own chat template and the file it came from (``TEMPLATE_FILES``, the
    first that holds one); None when none does."""
    for name in TEMPLATE_FILES:
        path = Path(folder) / name
        if path.is_file():
            source = read_template_file(path)
            if source:
                return source, path
    return None


def special_tokens_of(folder) -> dict[str, str]:
    """The special tokens a template may name (``bos_token``, ``eos_token``, ...) from ``folder``'s
    tokenizer_config.json, as transformers passes them to the renderer; empty without one."""
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def content_format(source: str) -> str:
    """``openai`` when the template loops over a message's ``content`` (``for x in m.content``,
    ``m['content'] | filter``, a ``content`` variable), else ``string``: the rule vLLM applies, simplified.
    ``ChatTemplateError`` when ``source`` is not Jinja that transformers' renderer compiles."""
    import jinja2
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(source).environment.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") from None

    def reads_content(node) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            return node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Name) and node.name == "content"

    return "openai" if any(reads_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


class JinjaChatTemplate(ChatTemplate):
    """A ``ChatTemplate`` rendered from Jinja ``source`` (the module docstring). ``special_tokens`` are the
    names a template may use (``bos_token``, ...); ``image_token`` the token the template writes for an image
    (None: a text model's template, which refuses images); ``end_of_turn`` the token an answer ends with (None:
    the special token the template writes right after an answer, else ``eos_token``)."""

    def __init__(self, tokenizer: Tokenizer, source: str, image_token: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, end_of_turn: str | None = None):
        super().__init__(tokenizer, image_token)
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        self.source = source
        self.format = content_format(source)
        self.special_tokens = dict(special_tokens or {})
        self._whole = Tokenizer.from_str(self.tokenizer.to_str())  # parses special tokens, as vLLM's does
        self._whole.encode_special_tokens = False
        decoder = self.tokenizer.get_added_tokens_decoder()
        self._special_ids = np.array(sorted(i for i, t in decoder.items() if t.special), dtype=np.int64)
        self._end_of_turn_id = None
        if end_of_turn is not None:
            self._end_of_turn_id = self._needed(end_of_turn)
        self._check()

    @property
    def end_of_turn_id(self) -> int:
        return self._end_of_turn_id

    def _needed(self, token: str) -> int:
        try:
            return self.special(token)
        except InvalidRequest as e:
            raise ChatTemplateError(str(e)) from None

    # ---- rendering -----------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message], placeholders: Sequence[int],
               add_generation_prompt: bool = True) -> tuple[list[int], list[ImageRun]]:
        self.check_arguments(messages, placeholders, add_generation_prompt)
        chat, values, images = self._sentinel_chat(messages, placeholders)
        text = self._render_text(chat, add_generation_prompt)
        return self._tokenize(text, values, images, placeholders)

    def _sentinel_chat(self, messages: Sequence[Message], placeholders: Sequence[int]):
        """The messages as the template sees them, each text and answer a sentinel; the sentinels' values (a
        str for a text, a list of ids for an answer) and the image indices in message order."""
        chat, values, images = [], [], []

        def sentinel(value) -> str:
            values.append(value)
            return f"{_OPEN}{len(values) - 1}{_CLOSE}"

        for i, message in enumerate(messages):
            self.check_message(i, message)
            if message.token_ids is not None:
                parts = [{"type": "text", "text": sentinel(self.answer_ids(i, message))}]
            else:
                parts = []
                for part in message.parts:
                    if isinstance(part, TextPart):
                        parts.append({"type": "text", "text": sentinel(part.text)})
                    else:
                        self.check_image(i, part, images, placeholders)
                        images.append(part.index)
                        parts.append({"type": "image"})
            if self.format == "string":
                content = "\n".join(p["text"] for p in parts if p["type"] == "text")
            else:
                content = parts
            chat.append({"role": message.role, "content": content})
        if len(images) != len(placeholders):
            raise InvalidRequest(f"placeholders for {len(placeholders)} image(s), but the messages hold "
                                 f"{len(images)} image part(s)")
        return chat, values, images

    def _render_text(self, chat: list[dict], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template([chat], chat_template=self.source,
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidRequest(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
        return rendered[0]

    def _tokenize(self, text: str, values: list, images: list[int],
                  placeholders: Sequence[int]) -> tuple[list[int], list[ImageRun]]:
        """Ids and image runs of rendered ``text`` (module docstring)."""
        ids: list[int] = []
        image_at: list[int] = []  # positions of the template's image tokens, before expansion
        segments: list[tuple[bool, str]] = []  # (is a text's value, characters) of the current piece
        seen_answers: set[int] = set()
        answer_end = None  # where the last answer ended, if the piece after it has not started
        cursor = 0
        for match in _SENTINEL.finditer(text):
            segments.append((False, text[cursor:match.start()]))
            cursor = match.end()
            k = int(match.group(1))
            if k >= len(values):
                raise InvalidRequest("the chat template wrote a sentinel that no message holds")
            if isinstance(values[k], str):
                segments.append((True, values[k]))
                continue
            if k in seen_answers:
                raise InvalidRequest("the chat template wrote an assistant answer twice")
            seen_answers.add(k)
            self._close_piece(ids, image_at, segments, answer_end)
            segments = []
            ids += values[k]
            answer_end = len(ids)
        segments.append((False, text[cursor:]))
        self._close_piece(ids, image_at, segments, answer_end)
        answers = sum(1 for v in values if not isinstance(v, str))
        if len(seen_answers) != answers:
            raise InvalidRequest(f"the chat template dropped {answers - len(seen_answers)} assistant answer(s)")
        if len(image_at) != len(images):
            raise InvalidRequest(f"the chat template wrote {len(image_at)} image token(s) for {len(images)} image(s)")
        return self._expand(ids, image_at, images, placeholders)

    def _close_piece(self, ids: list[int], image_at: list[int], segments: list[tuple[bool, str]],
                     answer_end: int | None) -> None:
        """Appends the ids of one piece (module docstring) to ``ids`` and its image tokens' positions to
        ``image_at``; after an answer that ends with the end-of-turn token, the piece's own first one is
        dropped."""
        for is_text, chars in segments:
            if not is_text and (_OPEN in chars or _CLOSE in chars):
                raise InvalidRequest("the chat template changed a message's text (cut or rewrote its sentinel)")
        piece = self._piece_ids(segments)
        eot = self._end_of_turn_id
        if (answer_end is not None and answer_end == len(ids) and ids and ids[-1] == eot and piece
                and piece[0] == eot):
            piece = piece[1:]
        if self.image_token_id is not None:
            image_at += (np.flatnonzero(np.asarray(piece, dtype=np.int64) == self.image_token_id) + len(ids)).tolist()
        ids += piece

    def _piece_ids(self, segments: list[tuple[bool, str]]) -> list[int]:
        """A piece tokenized whole, unless a special token overlaps a text's characters: then part by part."""
        whole = "".join(chars for _, chars in segments)
        if not whole:
            return []
        encoding = self._whole.encode(whole, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        special = np.flatnonzero(np.isin(ids, self._special_ids))
        if special.size and any(is_text for is_text, _ in segments):
            spans, at = [], 0
            for is_text, chars in segments:
                if is_text and chars:
                    spans.append((at, at + len(chars)))
                at += len(chars)
            offsets = encoding.offsets
            starts = [start for start, _ in spans]  # in order, disjoint: one search per special token
            for i in special.tolist():
                lo, hi = offsets[i]
                k = bisect.bisect_left(starts, hi) - 1  # the last text span starting before the token ends
                if k >= 0 and spans[k][1] > lo:
                    return [t for is_text, chars in segments if chars
                            for t in (self.tokenizer if is_text else self._whole).encode(
                                chars, add_special_tokens=False).ids]
        return ids.tolist()

    @staticmethod
    def _expand(ids: list[int], image_at: list[int], images: list[int],
                placeholders: Sequence[int]) -> tuple[list[int], list[ImageRun]]:
        out: list[int] = []
        runs: list[ImageRun] = []
        cursor = 0
        for position, index in zip(image_at, images):
            out += ids[cursor:position]
            runs.append(ImageRun(index, len(out), placeholders[index]))
            out += [ids[position]] * placeholders[index]
            cursor = position + 1
        out += ids[cursor:]
        return out, runs

    # ---- the probe -----------------------------------------------------------------------------------
    def _check(self) -> None:
        """Renders the probe chat and refuses the template where it breaks a rule (module docstring); finds the
        end-of-turn token when none was given."""
        with_images = self.image_token_id is not None
        if with_images and self.format == "string":
            raise ChatTemplateError("the chat template takes a message's content as a string, so it has no place "
                                    "for an image")
        word = self.text(" probe")
        image = [ImagePart(0), ImagePart(1)] if with_images else [None, None]
        turns = [[image[0], TextPart("Describe the first picture.")], [TextPart("And the words?")],
                 [TextPart("Compare it with this one."), image[1]]]
        chat: list[Message] = []
        previous: list[int] | None = None
        for n, parts in enumerate(turns):
            chat.append(Message("user", tuple(p for p in parts if p is not None)))
            ids, runs = self._probe(chat, True, n + 1)
            if previous is not None and ids[:len(previous)] != previous:
                raise ChatTemplateError(f"turn {n + 1} of a probe chat does not begin with turn {n}'s prompt plus "
                                        f"its answer: the template rewrites earlier turns, so no turn could reuse "
                                        f"the previous one's pages")
            if self._end_of_turn_id is None:
                self._end_of_turn_id = self._find_end_of_turn(chat, ids, word)
            answer = word * (n + 1) + ([self._end_of_turn_id] if n % 2 else [])  # the second ends its turn
            chat.append(Message("assistant", (), tuple(answer)))
            previous = ids + answer

    def _probe(self, chat: list[Message], add_generation_prompt: bool, turns: int):
        counts = [3, 2][:sum(isinstance(p, ImagePart) for m in chat for p in m.parts)]
        try:
            return self.render(chat, counts, add_generation_prompt)
        except InvalidRequest as e:
            raise ChatTemplateError(f"on a probe chat of {turns} turn(s): {e}") from None

    def _find_end_of_turn(self, chat: list[Message], prompt: list[int], word: list[int]) -> int:
        """The special token the template writes right after an answer; else ``eos_token``."""
        ids, _ = self._probe(chat + [Message("assistant", (), tuple(word))], False, 1)
        after = ids[len(prompt) + len(word):len(prompt) + len(word) + 1]
        if ids[:len(prompt)] == prompt and after and after[0] in self._special_ids:
            return int(after[0])
        eos = self.special_tokens.get("eos_token")
        if eos is None:
            raise ChatTemplateError("the chat template writes no special token after an answer and the tokenizer "
                                    "names no eos_token: no token ends a turn")
        return self._needed(eos)


# The engine's own templates as Jinja, written into exported folders (``mmcache export-model``) so that any
# server renders the same text. Each takes content as a string or as a list of parts; an answer is written as
# given (an answer generated after the generation prompt carries its own leading space).
LLAVA_JINJA = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- 'USER: ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '<image>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- ' ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}\n")
"""llava-1.5's Vicuna turns (``LlavaTemplate``): ``<s>{system} USER: <image>\\n{text} ASSISTANT:{answer}</s>``."""

CHATML_JINJA = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n")
"""Qwen2-VL's ChatML turns (``ChatMLTemplate``), no default system message."""

PLAIN_JINJA = (
    "{%- for message in messages -%}"
    "{{- message['role'] + ':' -}}"
    "{%- if message['role'] != 'assistant' -%}{{- ' ' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}\n")
"""Plain ``role: text`` lines (the server's ``PlainChatTemplate``) for text models without special turn tokens."""

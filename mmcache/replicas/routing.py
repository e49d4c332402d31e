"""Which engine replica a request goes to: the routing key, computed once at the ingress, and the Ray Serve
request routers of the engine deployment.

Rules:

* The routing key is one page name of the request's prompt, named as the engine names pages (``Namer``: a chain
  of xxHash rooted in a fingerprint and the request's salt), so two tenants' equal prompts get different keys
  and images count through their digests. For a chat it names the prompt up to where the first user message
  ends (at most ``depth_tokens``): the last full page's name, hashed with the tokens and image digests after it.
  Every turn of a chat begins with those tokens, so the key stays the same turn after turn, and it holds the
  chat's own words and images, so distinct chats spread even when they share a system prompt. For a plain completion it is the page ending at ``depth_tokens`` for a prompt
  that long, else the first full page. A text prompt is named from the token ids the ingress renders for the engine; a VLM chat from its
  messages rendered with one placeholder token per image, each image's placeholder carrying the digest of the
  image as sent (its data URL): the replica renders and encodes the images itself, so only the template runs
  twice, never the vision tower. The ingress's fingerprint is its own (model name, page size): a routing key
  only has to agree with itself, never with a replica's stored names.
* The routers themselves are in ``ray_routers`` (which imports Ray). ``MmcacheRouter`` (``--router mmcache``)
  sends a request to the replica that ``ReplicaRouter`` prefers among
  the live replicas, by rendezvous hashing of the key over the replicas' ids, unless that replica is past the
  load threshold (its queue, as Ray's queue-length cache reports it): then, and for a request without a key,
  Ray's power-of-two choices decide. It keeps no per-prefix state: a rendezvous ranker of the current replica
  set (rebuilt when the set changes) and Ray's own queue lengths are all it holds.
* ``PowerOfTwoRouter`` (``--router power-of-two``) is Ray Serve's default; ``PrefixTextRouter``
  (``--router prefix-text``) is Ray Serve LLM's ``PrefixCacheAffinityRouter``, which matches the prompt's text
  (the messages' text parts, images ignored) in a character tree. Every router here also honours a pinned call
  (``replica=ID`` among the call's keyword arguments): aborts and metrics scrapes go to the replica that holds
  the request, or to each replica in turn; a pinned replica that is gone is replaced by the router's own choice
  (an abort there finds nothing to end). Every router records the live replica ids for the ingress's scrape
  (``live_replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from ..errors import InvalidRequest
from ..names import Fingerprint, MediaItem, Namer, as_token_array, media_digest, page_extras

ROUTERS = ("mmcache", "power-of-two", "prefix-text")
"""The ``--router`` names (module docstring)."""

_LIVE: dict[str, tuple[str, ...]] = {}
"""Deployment name -> the replica ids its router last saw (this process's routers; the ingress reads it)."""


def live_replicas(deployment: str) -> tuple[str, ...]:
    """The ids of ``deployment``'s replicas as this process's router last saw them (empty before any call)."""
    return _LIVE.get(deployment, ())


def record_live(deployment: str, ids) -> None:
    """What a router calls with the replica ids it routes among."""
    _LIVE[deployment] = tuple(sorted(ids))


@dataclass
class EngineCall:
    """What the ingress sends an engine replica for one request: the engine request, its tenant, the routing
    key (``routing_name``) and the overflow's (``overflow_name``; both None when there is nothing to name), how
    long ago the request arrived (``age_s``: clocks of two machines do not compare, durations do), and the
    prompt for ``PrefixTextRouter`` (``messages``: a VLM chat's messages, else the prompt's text; None unless
    that router runs, or where the ids do not decode: it reads a call's ``messages`` whatever else the call holds,
    and a call whose text is empty or None goes by power-of-two choices)."""

    request: object
    owner: str | None
    routing_name: int | None
    age_s: float
    messages: list | str | None = None
    overflow_name: int | None = None  # where the overflow past the load threshold goes (``ReplicaRouter``)


class RoutingKey:
    """Computes requests' routing names for one model (``model`` names the fingerprint), ``page_size`` tokens a
    page, the key's page ending at ``depth_tokens`` at most (rounded down to a page, at least one); ``tokenizer``
    (a text model's, used on the event loop's thread only) and ``template`` (a VLM's chat template) find where a
    chat's first user message ends."""

    def __init__(self, model: str, page_size: int, depth_tokens: int, tokenizer=None, template=None):
        if isinstance(depth_tokens, bool) or not isinstance(depth_tokens, int) or depth_tokens < 1:
            raise InvalidRequest(f"depth_tokens must be a positive int, got {depth_tokens!r}")
        self.namer = Namer(Fingerprint(model_digest=f"route:{model}", kv_dtype="none", attention_backend="none",
                                       page_size=page_size))
        self.page_size = page_size
        self.depth_pages = max(1, depth_tokens // page_size)
        self.tokenizer = tokenizer
        self.template = template

    def of(self, request, messages=None) -> tuple[int | None, int | None]:
        """The routing and overflow names (``of_ids``) of an engine ``Request`` (token ids; ``messages``: the chat
        it renders, if it is one) or a VLM request (``messages``, or ``token_ids`` with ``images``)."""
        salt = getattr(request, "salt", b"")
        if getattr(request, "messages", None) is not None:  # a VLM chat
            ids, media, first_turn = self._rendered(request.messages)
        elif hasattr(request, "images"):  # a VLM completion: ids with one image token (or its run) per image
            ids = [int(t) for t in as_token_array(request.token_ids)]
            media, first_turn = self._media_in(ids, request.images), None
        else:
            ids, media = request.prompt, []
            first_turn = self._first_turn_estimate(messages) if messages else None
        return self.of_ids(ids, salt, media, first_turn)

    def of_ids(self, ids, salt=b"", media=(), first_turn: int | None = None) -> tuple[int | None, int | None]:
        """The routing name and the overflow name of a prompt (None, None when there is nothing to name).

        Routing name: for a chat (``first_turn``: where its first user message ends), the key of the prompt's
        first ``first_turn`` tokens (at most the depth): the name of their last full page, hashed with the
        tokens and image digests after it, so the key is the same at every turn of one chat and holds the chat's
        own words and images. For a prompt that is not a chat (None), the name of the depth's page for a prompt
        that long, else of its first page. Overflow name: the name of the page twice as deep as the routing
        name's (the prompt's last full page if it is shorter), what ``ReplicaRouter``'s ``deeper`` fallback
        ranks by past the load threshold."""
        ids = as_token_array(ids)
        media = list(media)
        extras = page_extras(media, self.page_size)
        root = self.namer.root(salt)
        full = len(ids) // self.page_size
        if first_turn is not None:
            end = min(first_turn, self.depth_pages * self.page_size, len(ids))
            if end <= 0:
                return None, None
            deeper = min(full, 2 * -(-end // self.page_size))
            names = self.namer.names(ids, root, extras, num_pages=deeper)  # only the pages the two names need
            whole = end // self.page_size
            base = int(names[whole - 1]) if whole else root
            tail = ids[whole * self.page_size:end].tobytes()
            tail += b"".join(m.digest + int(m.position).to_bytes(8, "little") for m in media
                             if whole * self.page_size <= m.position < end)
            name = xxhash.xxh64_intdigest(tail, base) if tail else base
            return name, (int(names[deeper - 1]) if deeper else None)
        if full == 0:
            return None, None
        names = self.namer.names(ids, root, extras, num_pages=min(full, 2 * self.depth_pages))
        page = self.depth_pages if full >= self.depth_pages else 1
        return int(names[page - 1]), int(names[len(names) - 1])

    def _rendered(self, messages) -> tuple[list[int], list[MediaItem], int | None]:
        from encoders.chat import parse_messages  # the VLM's own parser: images in request order

        parsed, sources = parse_messages(messages)
        ids, runs = self.template.render(parsed, [1] * len(sources), True)
        media = [MediaItem(_digest(sources[run.index]), run.start) for run in runs]
        first = _first_user(parsed)
        if first is None:
            return ids, media, None
        head = parsed[:first + 1]
        images = sum(1 for m in head for part in m.parts if not hasattr(part, "text"))
        return ids, media, len(self.template.render(head, [1] * images, False)[0])

    def _first_turn_estimate(self, messages) -> int | None:
        """Tokens of the texts up to and including the first user message (the template's own tokens left out,
        so it ends at or before that message's end in the rendered prompt); None without a user message."""
        first = _first_user(messages)
        if first is None or self.tokenizer is None:
            return None
        text = "".join(_text_of(m) for m in messages[:first + 1])
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _media_in(self, ids: list[int], images) -> list[MediaItem]:
        image_token = self.template.image_token_id
        starts = [i for i, t in enumerate(ids) if t == image_token and (i == 0 or ids[i - 1] != image_token)]
        return [MediaItem(_digest(image), start) for start, image in zip(starts, images)]


def _first_user(messages) -> int | None:
    return next((i for i, m in enumerate(messages) if getattr(m, "role", None) == "user"), None)


def _text_of(message) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") for part in content or ())


def _digest(source) -> bytes:
    raw = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else bytes(source)
    return media_digest(raw)

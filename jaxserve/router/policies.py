"""Which backend serves a request: round_robin, least_load, prefix.

Every policy answers with an ORDER over the healthy backends, not one pick: the router
tries them in that order, so a backend that fails before the first token is followed
by the policy's next choice (retry), not by a random one.

    policy = make_policy("prefix", prefix_chars=256)
    order = policy.order(healthy_backends, routing_key(body))   # -> [Backend, ...]

prefix: rendezvous (highest-random-weight) hashing of the prompt's first
`prefix_chars` characters. Each backend scores hash(key, backend url); the highest
score wins. Requests that share those characters meet the same backend and its prefix
cache; when a backend leaves, only its keys move (each to its own runner-up), and when
it comes back they return. The key is the raw text, not tokens: the router has no
tokenizer, and the same leading characters give the same leading tokens (up to the
boundary token) on any backend serving the same model.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Any, Protocol, Sequence

from jaxserve.router.backends import Backend

POLICIES = ("round_robin", "least_load", "prefix")
DEFAULT_PREFIX_CHARS = 256


class Policy(Protocol):
    name: str

    def order(self, backends: Sequence[Backend], key: str) -> list[Backend]:
        """backends: the healthy ones, in configuration order. -> all of them, best first."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, backends: Sequence[Backend], key: str) -> list[Backend]:
        if not backends:
            return []
        start = next(self._turn) % len(backends)
        return [*backends[start:], *backends[:start]]


class LeastLoad(RoundRobin):
    """Fewest requests first (Backend.load: the router's own in-flight count or the
    backend's last reported running + waiting, whichever is larger); ties go round-robin
    so that an idle pool still spreads."""
    name = "least_load"

    def order(self, backends: Sequence[Backend], key: str) -> list[Backend]:
        # sorted() is stable: the round-robin rotation breaks ties
        return sorted(super().order(backends, key), key=lambda b: b.load)


class PrefixHash:
    name = "prefix"

    def __init__(self, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> None:
        if prefix_chars < 1:
            raise ValueError(f"--prefix-chars must be >= 1, got {prefix_chars}")
        self.prefix_chars = prefix_chars

    def order(self, backends: Sequence[Backend], key: str) -> list[Backend]:
        lead = key[:self.prefix_chars].encode("utf-8", "surrogatepass")
        return sorted(backends, key=lambda b: _score(lead, b.url), reverse=True)


def _score(lead: bytes, url: str) -> int:
    # blake2b, not hash(): Python's string hash is salted per process, and every router
    # process (and a restarted one) must send a prefix to the same backend.
    h = hashlib.blake2b(lead, digest_size=8, key=url.encode()[:64])
    return int.from_bytes(h.digest(), "big")


def make_policy(name: str, *, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "prefix":
        return PrefixHash(prefix_chars)
    if name == "pd":
        raise ValueError("--policy pd takes --prefill and --decode URLs, not --backend "
                         "(router/pd.py)")
    raise ValueError(f"--policy must be one of {POLICIES}, got {name!r}")


class UnroutableError(ValueError):
    """A body field the router reads has the wrong type (-> 400 naming `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_fields(body: dict[str, Any]) -> None:
    """UnroutableError unless the fields the router reads (stream, n, prompt, messages)
    have the types the server takes: a body the router cannot read the same way the
    server will is refused here, not forwarded under a guessed routing key."""
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise UnroutableError("stream", "must be a boolean")
    n = body.get("n")
    if n is not None and type(n) is not int:          # type(): a bool is no count
        raise UnroutableError("n", "must be an integer")
    if "prompt" in body and not _is_prompt(body["prompt"]):
        raise UnroutableError("prompt", "must be a string, a list of strings, a list of "
                                        "token ids (integers) or a list of such lists")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise UnroutableError("messages", "must be a list of message objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise UnroutableError("messages", f"messages.{i}: must be an object")
            if not isinstance(m.get("role", ""), str):
                raise UnroutableError("messages", f"messages.{i}.role: must be a string")
            content = m.get("content")
            parts = isinstance(content, list) and all(isinstance(p, dict) for p in content)
            if not (content is None or isinstance(content, str) or parts):
                raise UnroutableError("messages", f"messages.{i}.content: must be a "
                                                  "string, null or a list of content parts")


def _is_ids(value: Any) -> bool:
    return all(type(v) is int for v in value)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list):
        return False
    if all(isinstance(v, str) for v in value):
        return True
    return _is_ids(value) or all(isinstance(v, list) and _is_ids(v) for v in value)


def routing_key(body: dict[str, Any]) -> str:
    """The text a prompt starts with: the completion prompt (token ids as their decimal
    text), the chat messages' roles and contents in order, or a Responses request's
    instructions and input (an embedding request's input). Total over any JSON body
    (a field of another type adds nothing to the key); check_fields refuses those
    first."""
    messages = body.get("messages")
    if "messages" in body:
        parts: list[str] = []
        for m in messages if isinstance(messages, list) else []:
            if isinstance(m, dict):
                role = m.get("role")
                parts.append(f"{role if isinstance(role, str) else ''}\x00"
                             f"{_text(m.get('content'))}\x00")
        return "".join(parts)
    if "input" in body:
        return _text(body.get("instructions")) + "\x00" + _input_text(body["input"])
    return _text(body.get("prompt"))


def _input_text(value: Any) -> str:
    """A Responses input (a string or items: messages with role and content) or an
    embedding input (strings or token ids) as text."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "".join(f"{role if isinstance(role := v.get('role'), str) else ''}\x00"
                       f"{_text(v.get('content'))}\x00" for v in value)
    return _text(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        return ""
    if _is_ids(value):
        return " ".join(map(str, value))
    if all(isinstance(v, dict) for v in value):        # chat content parts
        return "".join(t for p in value if isinstance(t := p.get("text"), str))
    return _text(value[0])          # a batch of prompts: the first leads

"""StructuredOutputsParams -> llguidance grammar text, and the checks run at intake.

    kind, key, grammar = to_grammar(params)   # pure, cached; SamplingParamsError if bad
    validate(params)                          # the intake check, in a pool, by a deadline
    await validate_async(params)              # the same, for the server's event loop

The grammar library is llguidance (chosen by measurement: docs/benchmarks.md, "Structured
outputs"). Its grammars are built lazily: turning a schema / regex / Lark text into a
grammar and checking it takes milliseconds and needs no tokenizer, so intake can refuse a
bad one with a 400 at once; what costs time (the token-level lexer, per tokenizer) is
built by the compile pool (backend.py) and, lazily, at mask time.

Bounds (a request over them fails alone, with a message naming the limit):
MAX_GRAMMAR_CHARS on the source text (schema as JSON, regex, grammar, choices),
PARSER_LIMITS on what llguidance may build (grammar symbols, lexer states, fuel), and
VALIDATE_TIMEOUT_S of wall time. The check itself can take a second on a hostile
grammar (a rule that doubles 26 times), so it never runs on the caller's thread: a
small pool runs it (llguidance releases the GIL) and the caller waits by a deadline.
"""
from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher, LLParserLimits

from jaxserve.sampling.params import SamplingParamsError, StructuredOutputsParams

PARAM = "structured_outputs"
MAX_GRAMMAR_CHARS = 64 * 1024          # source text of one constraint
MAX_CHOICES = 1024
VALIDATE_TIMEOUT_S = 5.0
VALIDATE_THREADS = 2
# llguidance's own bounds on what one grammar may build (its defaults are larger: 500k
# symbols, 250k lexer states); fuel bounds the regex work of one build / one mask step.
PARSER_LIMITS = dict(max_grammar_size=200_000, max_lexer_states=100_000,
                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot
# spend its tokens on whitespace, and the output is bounded by the schema's content.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> LLParserLimits:
    return LLParserLimits(**PARSER_LIMITS)


@dataclass(frozen=True, slots=True)
class GrammarSource:
    kind: str          # json | json_object | regex | choice | grammar
    key: str           # cache key: kind + canonical text
    grammar: str       # llguidance grammar text (what LLMatcher takes)


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[kind]


def source_text(p: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical source text); SamplingParamsError for a schema that is not JSON."""
    if p.json_object:
        return "json_object", '{"type": "object"}'
    if p.json is not None:
        schema = p.json
        if isinstance(schema, str):
            if len(schema) > MAX_GRAMMAR_CHARS:
                _too_large("JSON schema", len(schema))
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise SamplingParamsError(PARAM, "invalid JSON schema: nested too deeply"
                                          ) from None
            except json.JSONDecodeError as e:
                raise SamplingParamsError(PARAM, f"invalid JSON schema: not valid JSON ({e})"
                                          ) from None
        if not isinstance(schema, (dict, bool)):
            raise SamplingParamsError(PARAM, "invalid JSON schema: must be a JSON object, "
                                             f"got {type(schema).__name__}")
        try:
            # key order kept: llguidance emits properties in the schema's order
            return "json", json.dumps(schema, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise SamplingParamsError(PARAM, f"invalid JSON schema: {e}") from None
        except RecursionError:
            raise SamplingParamsError(PARAM, "invalid JSON schema: nested too deeply"
                                      ) from None
    if p.regex is not None:
        return "regex", p.regex
    if p.choice is not None:
        if len(p.choice) > MAX_CHOICES:
            raise SamplingParamsError(PARAM, f"choice: at most {MAX_CHOICES} choices, got "
                                             f"{len(p.choice)}")
        return "choice", json.dumps(p.choice)
    assert p.grammar is not None
    return "grammar", p.grammar


def _too_large(what: str, n: int) -> None:
    raise SamplingParamsError(PARAM, f"{what} too large: {n} characters, at most "
                                     f"{MAX_GRAMMAR_CHARS}")


def to_grammar(p: StructuredOutputsParams) -> GrammarSource:
    """The llguidance grammar of a constraint, checked (cached by its canonical text).
    Can take a second on a hostile grammar: call it off the engine thread and the
    event loop (validate, validate_async, the compile pool)."""
    return checked_source(*source_text(p))


def checked_source(kind: str, text: str) -> GrammarSource:
    """The checked grammar of a source_text() pair."""
    if len(text) > MAX_GRAMMAR_CHARS:
        _too_large(_what(kind), len(text))
    return _checked(kind, text)


@functools.lru_cache(maxsize=256)
def _checked(kind: str, text: str) -> GrammarSource:
    what = _what(kind)
    try:
        if kind in ("json", "json_object"):
            g = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "regex":
            g = LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            g = llguidance.grammar_from("choice", text)
        else:       # EBNF (GBNF) or Lark: llguidance converts GBNF to Lark
            g = llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise SamplingParamsError(PARAM, f"invalid {what}: {_first_lines(str(e))}") from None
    err = LLMatcher.validate_grammar(g, None, limits=parser_limits())
    if err:
        raise SamplingParamsError(PARAM, f"invalid {what}: {_first_lines(err)}")
    return GrammarSource(kind, f"{kind}:{text}", g)


_pool: ThreadPoolExecutor | None = None


def _submit(p: StructuredOutputsParams) -> Future:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(VALIDATE_THREADS, thread_name_prefix="grammar-check")
    return _pool.submit(to_grammar, p)


def _timed_out(timeout: float) -> SamplingParamsError:
    return SamplingParamsError(PARAM, f"checking the constraint took longer than "
                                      f"{timeout:g} s (too complex)")


def validate(p: StructuredOutputsParams | None, timeout: float = VALIDATE_TIMEOUT_S) -> None:
    """The intake check: SamplingParamsError (HTTP 400) naming the problem. Runs in
    the check pool; the caller waits at most `timeout`."""
    if p is None:
        return
    try:
        _submit(p).result(timeout=timeout)
    except FutureTimeout:
        raise _timed_out(timeout) from None


async def validate_async(p: StructuredOutputsParams | None,
                         timeout: float = VALIDATE_TIMEOUT_S) -> None:
    """validate() for a coroutine: the event loop keeps serving while the check runs."""
    if p is None:
        return
    try:
        await asyncio.wait_for(asyncio.wrap_future(_submit(p)), timeout)
    except asyncio.TimeoutError:
        raise _timed_out(timeout) from None


def _first_lines(msg: str, n: int = 6) -> str:
    """llguidance's messages carry a caret diagram; keep it short."""
    lines = [ln.rstrip() for ln in msg.strip().splitlines() if ln.strip()]
    return " | ".join(lines[:n])

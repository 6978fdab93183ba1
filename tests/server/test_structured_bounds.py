"""Hostile constraints cost bounded time and memory, and none of it on the caller's
thread: the schema analysis is linear, the device compile runs in a child process that
is killed at its deadline, the grammar check and compile run in pools."""
from __future__ import annotations

import asyncio
import time

import pytest

from jaxserve.sampling.params import SamplingParamsError
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured import grammar
from jaxserve.structured.backend import GrammarBackend, GrammarError
from jaxserve.structured.device_automaton import NotOnDevice, _SchemaGraph, device_regex
from jaxserve.structured.device_compiler import DeviceCompiler
from jaxserve.structured.device_vocab import TokenVocabulary
from test_structured_outputs_http import CATASTROPHIC_REGEX, DOUBLING_GBNF, ref_dag


def byte_vocab() -> TokenVocabulary:
    """Every byte a token, plus two longer ones; EOS 300."""
    tokens = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"ba"}
    return TokenVocabulary(tokens, (300,), 301)


def test_reference_dag_analysis_is_linear():
    """22 levels of 'the next definition, twice' is 4 million paths: the old walk over
    every path took minutes; the graph is walked once per node."""
    t0 = time.perf_counter()
    with pytest.raises(NotOnDevice, match="expand to more than"):
        device_regex(SO(json=ref_dag(22)))
    assert time.perf_counter() - t0 < 1.0
    assert device_regex(SO(json=ref_dag(2)))           # a small DAG is still regular
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    assert _SchemaGraph(tree).has_cycle() and not _SchemaGraph(ref_dag(30)).has_cycle()
    deep: dict = {"type": "integer"}
    for _ in range(5000):                              # no recursion in the walk itself
        deep = {"type": "array", "items": deep}
    assert not _SchemaGraph(deep).has_cycle()


def test_catastrophic_regex_compile_is_killed_at_its_deadline():
    """(a|b)*a(a|b){24} has 2^24 DFA states: the child building it is killed at the
    deadline, the constraint is remembered as host-only, and the next compile gets a
    fresh child."""
    c = DeviceCompiler(byte_vocab, deadline_s=2.0)
    try:
        t0 = time.perf_counter()
        job = c.submit(SO(regex=CATASTROPHIC_REGEX))
        assert time.perf_counter() - t0 < 0.1            # the caller only queues it
        with pytest.raises(NotOnDevice, match="longer than 2 s"):
            c.compile(SO(regex=CATASTROPHIC_REGEX), wait_s=30)
        assert time.perf_counter() - t0 < 10 and job.done()
        assert c.worker.restarts == 1
        with pytest.raises(NotOnDevice, match="longer than"):   # cached: no second try
            c.compile(SO(regex=CATASTROPHIC_REGEX), wait_s=0.0)
        key, tables = c.compile(SO(regex="[ab]{3}"), wait_s=30)
        assert key == "[ab]{3}" and tables.walk([256, 97]) != 0
        assert set(tables.allowed(0)) == {97, 98, 256, 257}
    finally:
        c.shutdown()


def test_engine_side_calls_only_queue_work():
    """What the engine thread calls returns at once, whatever the constraint: the
    check and compile of a doubling grammar, the device analysis of a reference DAG."""
    backend = GrammarBackend(None, vocab_size=301, eos_token_ids=(300,))
    c = DeviceCompiler(byte_vocab)
    try:
        t0 = time.perf_counter()
        job = backend.submit(SO(grammar=DOUBLING_GBNF))
        dev = c.submit(SO(json=ref_dag(30)))
        assert time.perf_counter() - t0 < 0.05
        with pytest.raises(GrammarError, match="invalid grammar"):
            job.result()
        assert isinstance(dev.result(timeout=30)[1], NotOnDevice)
    finally:
        backend.shutdown()
        c.shutdown()


def test_grammar_check_leaves_the_event_loop_free():
    """The intake check of a doubling grammar (about a second of llguidance work) runs
    in the check pool: the event loop keeps turning meanwhile."""
    async def main() -> float:
        gaps: list[float] = []

        async def tick() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                gaps.append(time.perf_counter() - t)

        ticker = asyncio.create_task(tick())
        with pytest.raises(SamplingParamsError, match="invalid grammar"):
            await grammar.validate_async(SO(grammar=DOUBLING_GBNF))
        ticker.cancel()
        return max(gaps)
    assert asyncio.run(main()) < 0.25


def test_grammar_check_deadline():
    """Past its deadline the check is a 400 naming the reason (the caller stops
    waiting; llguidance's fuel ends the work itself)."""
    with pytest.raises(SamplingParamsError, match="took longer than"):
        grammar.validate(SO(grammar=DOUBLING_GBNF.replace("a0", "b0", 1)
                            .replace("root ::= b0", "root ::= a0 a0")), timeout=0.001)

"""Prompt logprobs over HTTP: lm-evaluation-harness's loglikelihood request against a
real `jaxserve serve` process (the CLI, on a tiny transformers checkpoint saved to
disk), with the official `openai` client, checked against transformers' log-softmax of
the same checkpoint within 1e-3.

lm-eval's `local-completions` model scores (context, continuation) pairs by sending,
for a batch of them, exactly: {"model", "prompt": [token ids of context+continuation,
...], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}
(lm_eval/models/openai_completions.py, `_create_payload` with generate=False), and
reads choice["logprobs"]["token_logprobs"][ctxlen:-1] (their sum) and
["top_logprobs"][ctxlen:-1] (greedy = each token's logprob is its position's max).
Also: echo with max_tokens 0, streamed echo, vLLM's `prompt_logprobs` field on
completions (per choice) and chat (top level), and the 400s.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from model_utils import save_hf_model

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-3
MODEL = "tiny-ckpt"
# A 32-token step budget: the longer prompts are prefilled in chunks.
SERVE_FLAGS = ["--max-num-batched-tokens", "32", "--token-buckets", "8", "32",
               "--max-num-seqs", "8", "--max-model-len", "128", "--num-kv-blocks", "64",
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    hf = save_hf_model("llama_gqa", path, seed=7)
    return path, hf


@pytest.fixture(scope="module")
def server(checkpoint):
    """`jaxserve serve <checkpoint>` in its own process; yields its base URL."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", str(checkpoint[0]), *SERVE_FLAGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, seen = None, []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "serving" in line and "http://" in line:
                url = line.split(" on ")[1].split()[0]
                break
        assert url, "server did not start:\n" + "".join(seen[-30:])
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ref_logprobs(hf, ids: list[int]) -> np.ndarray:
    """transformers: log-softmax over the sequence, row j predicting token j+1."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@functools.lru_cache(maxsize=None)
def _tokenizer(tok_path: Path):
    """The checkpoint's tokenizer as the client side loads it, read once per module."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(tok_path))


def encode(tok_path: Path, text: str) -> list[int]:
    return _tokenizer(tok_path)(text).input_ids


PAIRS = [("Question: what is 2+2?\nAnswer:", " 4"),
         ("The quick brown fox jumps over the lazy", " dog"),
         ("def add(a, b):\n    return", " a + b"),
         ("Once upon a time, in a village far, far away, there lived a wise old owl who",
          " knew every secret of the forest.")]


def test_lm_eval_loglikelihood_request_matches_transformers(checkpoint, client):
    path, hf = checkpoint
    ctxs = [encode(path, c) for c, _ in PAIRS]
    fulls = [encode(path, c + x) for c, x in PAIRS]
    assert all(f[:len(c)] == c for c, f in zip(ctxs, fulls))
    # lm-eval's payload, verbatim (a batch of token-id prompts)
    r = client.completions.create(model=MODEL, prompt=fulls, temperature=0, max_tokens=1,
                                  logprobs=1, seed=1234, echo=True)
    assert len(r.choices) == len(PAIRS)
    for choice, ctx, full in zip(sorted(r.choices, key=lambda c: c.index), ctxs, fulls):
        lp = choice.logprobs
        n = len(full)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert choice.text.startswith(encode_text(path, full))
        ref = ref_logprobs(hf, full)
        got = np.array(lp.token_logprobs[1:n], np.float64)
        want = ref[np.arange(n - 1), full[1:]]
        assert np.abs(got - want).max() < ATOL, np.abs(got - want).max()
        # what lm-eval computes from it: the continuation's sum and greediness
        ctxlen = len(ctx)
        score = sum(lp.token_logprobs[ctxlen:-1])
        greedy = all(t == max(top.values())
                     for t, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
        want_score = float(sum(ref[j - 1, full[j]] for j in range(ctxlen, n)))
        want_greedy = all(ref[j - 1].argmax() == full[j] for j in range(ctxlen, n))
        assert abs(score - want_score) < ATOL * (n - ctxlen)
        assert greedy == want_greedy
        # the generated token's logprob (greedy: the max of the last row)
        assert abs(lp.token_logprobs[n] - ref[n - 1].max()) < ATOL


def encode_text(path: Path, ids: list[int]) -> str:
    return _tokenizer(path).decode(ids, skip_special_tokens=True)


def test_echo_text_prompt_and_max_tokens_zero(checkpoint, client):
    path, hf = checkpoint
    text = "Hello, world! This prompt is scored, not continued."
    ids = encode(path, text)
    ref = ref_logprobs(hf, ids)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, logprobs=2,
                                  echo=True, temperature=0)
    c = r.choices[0]
    assert c.text == text                     # the prompt only: nothing generated shown
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    got = np.array(c.logprobs.token_logprobs[1:], np.float64)
    assert np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]]).max() < ATOL
    assert all(len(top) in (2, 3) for top in c.logprobs.top_logprobs[1:])
    assert c.logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in
                                                           c.logprobs.tokens[:-1]]))


def test_streamed_echo_equals_non_streamed(checkpoint, client):
    path, _ = checkpoint
    prompt = encode(path, "Streaming the prompt back, then four tokens")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, echo=True,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    tokens, lps, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert text == full.text and tokens == full.logprobs.tokens
    assert lps[0] is None and np.allclose(lps[1:], full.logprobs.token_logprobs[1:], atol=1e-5)


def test_prompt_logprobs_field_completions_and_chat(checkpoint, server, client):
    path, hf = checkpoint
    ids = encode(path, "vLLM's extra request field")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    _check_field(plp, ids, ref_logprobs(hf, ids), 3)
    assert r.choices[0].logprobs is None
    messages = [{"role": "user", "content": "Score this chat prompt."}]
    chat_ids = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages},
                          timeout=30).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       temperature=0, extra_body={"prompt_logprobs": 1})
    _check_field(r.model_extra["prompt_logprobs"], chat_ids, ref_logprobs(hf, chat_ids), 1)


def _check_field(plp: list, ids: list[int], ref: np.ndarray, k: int) -> None:
    """vLLM's JSON: [None, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]."""
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and len(entry) in (k, k + 1)
        for t, v in entry.items():
            assert abs(v["logprob"] - ref[i - 1, int(t)]) < ATOL
            assert isinstance(v["rank"], int) and isinstance(v["decoded_token"], str)


def test_streamed_prompt_logprobs_field_is_a_400(server):
    for path, body in [("/v1/completions", {"prompt": "abc"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "abc"}]})]:
        r = httpx.post(f"{server}{path}", json={**body, "model": MODEL, "stream": True,
                                                "prompt_logprobs": 1}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_logprobs"
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "abc",
                                                     "prompt_logprobs": 99}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

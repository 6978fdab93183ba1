"""Output-processing time per engine step: Rust DecodeStream vs the Python detokenizer.

    .venv/bin/python scripts/bench_detokenizer.py [--seqs 64 256] [--steps 256] [--repeat 3]

Feeds synthetic engine outputs (one token per sequence per step, DELTA outputs as the
server uses) through the OutputProcessor with the default model's tokenizer
(SmolLM2-135M-Instruct, byte-level BPE), once with the Rust DecodeStream and once with
the Python path forced (`stream_backend` patched to None: exactly the pre-DecodeStream
code). Each sequence replays the tokens of a multilingual text from its own offset, so
steps mix ASCII words, multi-byte characters and byte pieces. Timed in CPU time of this
thread (time.thread_time); the two variants alternate per repeat, and the medians of
the per-step times are reported.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.frontend import detokenizer  # noqa: E402
from jaxserve.core.engine_core import EngineCoreOutput  # noqa: E402
from jaxserve.frontend.output_processor import OutputProcessor  # noqa: E402
from jaxserve.request import FinishReason  # noqa: E402
from jaxserve.sampling.params import RequestOutputKind, SamplingParams  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog, then writes a report about it. "
        "Der schnelle braune Fuchs springt über den faulen Hund. 日本語の文章も少し混ぜます。"
        "Быстрая коричневая лиса прыгает через ленивую собаку. 🦊🐶 ¿Qué tal? "
        "def f(x):\n    return x ** 2  # code, too\n") * 8


def run(tok, token_stream: list[int], prompt: list[int], seqs: int, steps: int,
        stream: bool) -> list[float]:
    real = detokenizer.stream_backend
    if not stream:
        detokenizer.stream_backend = lambda _t: None      # the Python path only
    try:
        proc = OutputProcessor(tok)
        params = SamplingParams(max_tokens=steps, temperature=0,
                                output_kind=RequestOutputKind.DELTA)
        for i in range(seqs):
            proc.add_request(str(i), None, prompt, {f"{i}-0": params})
        n = len(token_stream)
        times = []
        for s in range(steps):
            last = s == steps - 1
            outs = [EngineCoreOutput(f"{i}-0", [token_stream[(i * 37 + s) % n]],
                                     FinishReason.LENGTH if last else None)
                    for i in range(seqs)]
            t0 = time.thread_time()
            proc.process(outs)
            times.append(time.thread_time() - t0)
        return times
    finally:
        detokenizer.stream_backend = real


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    from jaxserve.model.loader.default_model import default_model_path
    from jaxserve.model.tokenizer.load import load_tokenizer
    tok = load_tokenizer(default_model_path())
    token_stream = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")
    print(f"tokenizer {type(tok).__name__}, DecodeStream usable: "
          f"{detokenizer.stream_backend(tok) is not None}")
    print("| sequences | Python path (ms/step) | DecodeStream (ms/step) | speed-up |")
    print("|---|---|---|---|")
    for seqs in a.seqs:
        res: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeat):
            for stream in (False, True):
                res[stream].append(statistics.median(
                    run(tok, token_stream, prompt, seqs, a.steps, stream)))
        py, rs = min(res[False]) * 1e3, min(res[True]) * 1e3
        print(f"| {seqs} | {py:.2f} | {rs:.2f} | {py / rs:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

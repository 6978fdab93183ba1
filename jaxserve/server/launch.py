"""`jaxserve serve`: load the model, warm the engine up, run uvicorn.

    serve(EngineArgs(port=8000)) -> exit code (0 after a SIGTERM / Ctrl-C shutdown,
                                    1 after the engine died or when its thread did not
                                    stop; uvicorn_server.py: a second signal or the
                                    exit deadline end the process with os._exit)
"""
from __future__ import annotations

import gc
import logging
import signal
import time
from pathlib import Path
from typing import Any

from jaxserve.config import EngineArgs
from jaxserve.frontend.async_engine import AsyncEngine
from jaxserve.frontend.input_processor import InputLimits
from jaxserve.model.loader.hub import is_repo_id
from jaxserve.server.listen import bind

log = logging.getLogger("jaxserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_engine(args: EngineArgs, model_cfg: Any, weights: Any, tokenizer: Any, *,
                 warmup: bool = True) -> AsyncEngine:
    """EngineCore (compiled for every bucket when warmup) wrapped in an AsyncEngine.
    tokenizer may be a BackgroundTokenizer: the engine starts its load when its warm-up
    starts, and it is awaited here once the engine is built."""
    from jaxserve.core.data_parallel import make_engine
    from jaxserve.model.tokenizer.load import resolved
    eos = tuple(model_cfg.eos_token_ids)
    if not eos:
        tokenizer = resolved(tokenizer)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos = (tokenizer.eos_token_id,)
    core = make_engine(args, model_cfg, weights, eos_token_ids=eos, warmup=warmup,
                       tokenizer=tokenizer)
    try:
        tokenizer = resolved(tokenizer)
    except BaseException:
        core.shutdown()
        raise
    return AsyncEngine(core, tokenizer, max_n=args.max_n, max_logprobs=args.max_logprobs,
                       limits=InputLimits.from_args(args), step_timeout=args.step_timeout,
                       max_open_seqs=args.max_num_seqs * args.data_parallel_size
                       + args.max_waiting_requests)


def freeze_heap() -> None:
    """Take everything alive once the engine is warm out of the cyclic collector's view.

    The weights, the engine and jax's trace and compile caches (about half a million
    Python objects for the default model) live as long as the process. Each full
    collection of Python's cyclic collector scans them all while holding the GIL:
    about a second on a loaded 2-core machine (docs/benchmarks.md), during which the
    engine thread and the event loop both stand still, and the collector runs one
    whenever enough objects have survived since the last. gc.freeze moves what exists
    now to a permanent generation (vLLM does the same after start-up); what requests
    create later is collected as usual."""
    gc.collect()
    gc.freeze()


def model_name(args: EngineArgs) -> str:
    """The primary served name: the first --served-model-name, else the repo id the
    model was named by, else the model file's or directory's name."""
    if args.served_model_name:
        return args.served_model_name[0]
    if args.model is None:
        return DEFAULT_MODEL_NAME
    if is_repo_id(args.model):
        return args.model
    p = Path(args.model)
    return p.stem if p.suffix == ".gguf" else p.name


def run_server(engine: AsyncEngine, tokenizer: Any, args: EngineArgs, name: str) -> int:
    """Serve until SIGTERM/SIGINT (-> 0; in-flight requests get args.shutdown_timeout s)
    or until the engine dies (-> 1, after draining what it can). If the engine thread is
    still busy after the drain (wedged), the process ends here with status 1."""
    from jaxserve.server.api import build_app
    from jaxserve.server.uvicorn_server import hard_exit, make_server
    app = build_app(engine, tokenizer, model_name=name, args=args)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    auth = ' -H "Authorization: Bearer $KEY"' if args.api_key else ""
    print(f"jaxserve: serving {name!r} on {url} (OpenAI API at {url}/v1)\n"
          f"  curl {url}/v1/completions{auth} -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
          f"  python: OpenAI(base_url=\"{url}/v1\", api_key=\"...\")", flush=True)
    server = make_server(app, engine, args)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully;
    # a no-op SIGTERM handler turns that into a clean exit 0 (SIGINT stays Ctrl-C).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()      # the engine's own threads (data parallel replicas) end here
    if not engine.drained_cleanly:
        # The interpreter's exit would run atexit hooks (JAX's backend teardown among
        # them) beside a thread that still uses the engine, and could wait on it.
        status = server.exit_code or 1
        quiet, activity = engine.stalled_for()
        hard_exit(status, f"server stopped without a clean drain: the engine thread is "
                          f"still busy in {activity} (its loop last turned {quiet:.0f} s "
                          f"ago); exit status {status}")
    log.info("server stopped (exit status %d)", server.exit_code)
    return server.exit_code


def _import_server() -> None:
    import jaxserve.server.api  # noqa: F401
    import jaxserve.server.uvicorn_server  # noqa: F401


def serve(args: EngineArgs) -> int:
    from jaxserve.core.multihost import engine as multihost
    code = multihost.maybe_follow(args)      # ranks > 0 of a multi-host run follow rank 0
    if code is not None:
        return code
    try:
        return _serve_leader(args, multihost)
    finally:
        multihost.shutdown()


def _serve_leader(args: EngineArgs, multihost: Any) -> int:
    import jax
    from jaxserve.model.loader.load import load_model, tokenizer_of
    from jaxserve.model.tokenizer.load import BackgroundTokenizer
    if args.skip_tokenizer_init:        # not silently ignored: the API needs text
        raise ValueError("--skip-tokenizer-init is for the Python API (LLM with "
                         "token-id prompts); jaxserve serve needs the tokenizer")
    t0 = time.perf_counter()
    if jax.default_backend() == "cpu":     # (multi-host: jax.distributed is up by now)
        # a first start builds the C++ kernels (a compiler process per source) while the
        # model loads, instead of after it; later starts only load the library
        from kernels_cpu.ragged_paged_attention import build
        build.load_in_background()
    loaded = load_model(args.model, dtype=args.dtype, shardings=multihost.weight_shardings(args),
                        quantization=args.quantization, skip_tokenizer=True)
    log.info("loaded %s (%s) in %.1f s", loaded.source, loaded.format, loaded.load_seconds)

    def front_end() -> Any:
        # the HTTP side's imports (fastapi, pydantic models, uvicorn) and the tokenizer
        # (importing transformers): mostly pure Python, on one thread that the engine
        # starts when its warm-up starts (BackgroundTokenizer). Beside the weights'
        # packing, many short numpy calls, it slowed both by the GIL's handoffs; beside
        # the warm-up, which runs mostly in XLA, it costs the start far less
        # (docs/benchmarks.md, "Start-up").
        _import_server()
        return tokenizer_of(loaded.source, loaded.format)
    engine = build_engine(args, loaded.config, loaded.weights, BackgroundTokenizer(front_end))
    freeze_heap()
    core = engine.core
    leader = multihost.attach_leader(core, args) if args.num_hosts > 1 else None
    log.info("engine ready in %.1f s (warm-up %.1f s): max_model_len=%d, %d KV blocks of %d "
             "tokens, max_num_seqs=%d, max_num_batched_tokens=%d, %d compiled shapes",
             time.perf_counter() - t0, core.warmup_seconds, core.max_model_len,
             core.snapshot().num_blocks, args.block_size, args.max_num_seqs,
             args.max_num_batched_tokens, core.num_compiles)
    try:
        return run_server(engine, engine.tokenizer, args, model_name(args))
    finally:
        if leader is not None:
            leader.stop()

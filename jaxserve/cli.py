"""`jaxserve serve | generate | bench | convert | router | tools`."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable

from jaxserve.bench.commands import add_bench_parsers
from jaxserve.config import ConfigError
from jaxserve.cli_args import HelpFormatter, add_cli_args, engine_args, engine_parser
from jaxserve.deps import MissingDependencyError

log = logging.getLogger("jaxserve")


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams
    args = engine_args(ns)
    llm = LLM(**{k: v for k, v in vars(args).items()})
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, seed=ns.sampling_seed)
    if ns.chat:
        outs = llm.chat([{"role": "user", "content": p} for p in ns.prompt][:1], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(list(ns.prompt), params, use_tqdm=len(ns.prompt) > 1)
    for out in outs:
        print(out.outputs[0].text)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    args = engine_args(ns)
    if args.model is not None:      # a repo id: fetched (or found cached) once, here, so
        from jaxserve.model.loader.hub import is_repo_id, resolve_repo  # replicas share it
        if is_repo_id(args.model):
            resolve_repo(args.model)
    if args.kv_transfer_config:     # before any model loads: a missing secret fails fast
        from jaxserve.kv_transfer.config import parse_kv_transfer_config, read_secret
        read_secret(parse_kv_transfer_config(args.kv_transfer_config), args.api_key)
    if args.data_parallel_size > 1 and args.data_parallel_backend == "processes":
        from jaxserve.router.dp_processes import serve_replicas
        return serve_replicas(args)
    from jaxserve.server.launch import serve
    return serve(args)


def cmd_convert(ns: argparse.Namespace) -> int:
    from jaxserve.model.loader.convert import convert
    out = convert(None if ns.src == "default" else ns.src, ns.dst, ns.dtype)
    print(f"converted {ns.src} -> {out}")
    return 0

def cmd_router(ns: argparse.Namespace) -> int:
    from jaxserve.deps import require
    require("httpx", extra="router", feature="jaxserve router")
    from jaxserve.router import RouterConfig, Timeouts, run_router
    if (ns.policy == "pd") != bool(ns.prefill or ns.decode):
        raise ValueError("--prefill and --decode go with --policy pd (disaggregated "
                         "prefill and decode), and --policy pd needs them")
    if ns.policy == "pd" and ns.backend:
        raise ValueError("--policy pd takes --prefill and --decode URLs, not --backend")
    if ns.policy != "pd" and not ns.backend:
        raise ValueError("give at least one --backend URL (a `jaxserve serve` server)")
    return run_router(RouterConfig(
        backends=ns.backend, prefill=ns.prefill, decode=ns.decode, policy=ns.policy, host=ns.host, port=ns.port,
        api_key=ns.api_key, backend_api_key=ns.backend_api_key, prefix_chars=ns.prefix_chars,
        poll_interval=ns.poll_interval, timeouts=Timeouts(read=ns.backend_timeout),
        max_request_body_bytes=ns.max_request_body_bytes, public_metrics=ns.public_metrics))


def _router_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="route OpenAI requests to several jaxserve servers",
                       description="An OpenAI-route proxy in front of `jaxserve serve` "
                                   "backends (docs/serving.md, Router).",
                       formatter_class=HelpFormatter)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a backend server's URL (repeat for each)")
    p.add_argument("--policy", default="round_robin",
                   choices=("round_robin", "least_load", "prefix", "pd"),
                   help="pd: disaggregated prefill/decode over --prefill and --decode "
                        "servers (started with --kv-transfer-config)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="--policy pd: a prefill server (kv_producer; repeat for each)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="--policy pd: a decode server (kv_consumer; repeat for each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key", default=None, help="key clients must send (Bearer)")
    p.add_argument("--backend-api-key", default=None, help="key the router sends to backends")
    p.add_argument("--prefix-chars", type=int, default=256,
                   help="prefix policy: leading prompt characters that pick the backend")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between backend health (and, least_load, /metrics) checks")
    p.add_argument("--backend-timeout", type=float, default=600.0,
                   help="longest wait for a backend's next bytes (a non-streamed request's "
                        "whole generation)")
    p.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--public-metrics", action="store_true",
                   help="serve the router's /metrics without the API key")
    p.set_defaults(fn=cmd_router)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference engine on JAX/XLA (OpenAI-compatible server, "
                                     "offline generation, benchmarks).")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = engine_parser(sub, "serve", "serve the OpenAI-compatible HTTP API")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("generate", help="generate text for prompts and print it",
                       formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="+", help="prompt text(s)")
    p.add_argument("--model", dest="model_pos", default=None, help="model (default: embedded)")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_cli_args(p, skip=("model",))
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("convert", help="convert a checkpoint (HF dir / GGUF) to jaxserve's orbax "
                                       "format (per-device restores for sharded runs)")
    p.add_argument("src", help="source checkpoint (HF directory or .gguf); 'default' = embedded model")
    p.add_argument("dst", help="destination directory")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.set_defaults(fn=cmd_convert)

    _router_parser(sub)

    add_bench_parsers(sub)

    from jaxserve.tools import add_tools_parser
    add_tools_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fn: Callable[[argparse.Namespace], int] = ns.fn
    try:
        return fn(ns)
    except (ConfigError, ValueError, FileNotFoundError, MissingDependencyError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

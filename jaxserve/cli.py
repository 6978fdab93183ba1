"""`jaxserve serve | generate | bench | convert`."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Callable

from jaxserve.config import ConfigError, HelpFormatter, add_cli_args, engine_args_from_cli
from jaxserve.deps import MissingDependencyError

log = logging.getLogger("jaxserve")


def _engine_parser(sub: Any, name: str, help: str, *, model_positional: bool = True,
                   skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help,
                       formatter_class=HelpFormatter)
    if model_positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="HF dir, .gguf file or orbax dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, help="YAML file of settings (keys = flag names in "
                                                  "snake_case); flags override it")
    add_cli_args(p, skip=skip)
    return p


def _args(ns: argparse.Namespace):
    return engine_args_from_cli(ns, model=getattr(ns, "model_pos", None))


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams
    args = _args(ns)
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
    from jaxserve.server.main import serve
    return serve(_args(ns))


def cmd_convert(ns: argparse.Namespace) -> int:
    from jaxserve.model.loader import convert
    out = convert(None if ns.src == "default" else ns.src, ns.dst, ns.dtype)
    print(f"converted {ns.src} -> {out}")
    return 0

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference engine on JAX/XLA (OpenAI-compatible server, "
                                     "offline generation, benchmarks).")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = _engine_parser(sub, "serve", "serve the OpenAI-compatible HTTP API")
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
                                       "format (the fast path)")
    p.add_argument("src", help="source checkpoint (HF directory or .gguf); 'default' = embedded model")
    p.add_argument("dst", help="destination directory")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.set_defaults(fn=cmd_convert)

    from jaxserve.bench.main import add_bench_parsers
    add_bench_parsers(sub, _engine_parser)
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

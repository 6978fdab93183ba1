"""A test proposer whose proposals are mostly right: a tiny random model does not copy
its prompt, so n-gram proposals are rarely accepted on it. This one proposes each
request's known greedy continuation, with every third proposal run corrupted at one
position, so steps accept all, some or none of their proposals. Any proposal that
depends only on the tokens so far keeps verification exact, so the engine's outputs
must not change with it."""
from __future__ import annotations


class OracleProposer:
    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]],
                 vocab: int) -> None:
        self.k, self.cont, self.vocab = k, continuations, vocab
        self.calls = 0

    def propose(self, req_id: str, prompt: list[int], output: list[int],
                max_k: int) -> list[int]:
        ref = self.cont.get(tuple(prompt), [])
        j = len(output)
        out = list(ref[j:j + min(self.k, max_k)])
        self.calls += 1
        if out and self.calls % 3 == 0:
            i = (j + len(prompt)) % len(out)
            out[i] = 3 + (out[i] - 2) % (self.vocab - 3)       # another non-special id
        return out

    def forget(self, req_id: str) -> None:
        pass


def use_oracle(llm, prompts: list[list[int]], continuations: list[list[int]],
               k: int = 3) -> OracleProposer:
    oracle = OracleProposer(k, {tuple(p): c for p, c in zip(prompts, continuations)},
                            llm.model_config.vocab_size)
    llm.engine.scheduler.proposer = oracle
    return oracle


def drafting_target():
    """(config, weights, tokenizer) of a three-layer tiny model whose last layer is
    scaled down: its first two layers (the drafts) agree with it often but not always,
    so steps accept all, some or none of the proposals."""
    from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
    cfg = tiny_config(num_layers=3)
    w = tiny_weights(cfg)
    last = dict(w["layers"][2])
    for name in ("wo", "w_down"):
        last[name] = last[name] * 0.15
    return cfg, {**w, "layers": [*w["layers"][:2], last]}, tiny_tokenizer()


def save_checkpoint(cfg, weights, tok, path) -> str:
    """The model as a Hugging Face checkpoint folder (a draft model's path)."""
    from jaxserve.model.export import to_transformers
    to_transformers(cfg, weights).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def spy_chunked_prefills(llm) -> list[str]:
    """Wrap the engine's scheduler so that the ids of new requests scheduled with only
    part of their prompt are appended to the returned list."""
    chunked: list[str] = []
    orig = llm.engine.scheduler.schedule

    def spy(speculate=False):
        so = orig(speculate=speculate)
        for new in so.scheduled_new_reqs:
            if so.num_scheduled_tokens[new.req_id] + new.num_computed_tokens < len(new.token_ids):
                chunked.append(new.req_id)
        return so
    llm.engine.scheduler.schedule = spy
    return chunked

"""Named, seeded workloads shared by every benchmark (docs/benchmarks.md, "Workloads")."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def shared_offline(vocab_size: int, num_prompts: int = 64, min_len: int = 16,
                   max_len: int = 256, output_len: int = 64, seed: int = 0) -> Workload:
    """64 prompts of random ids, lengths uniform in 16..256, 64 output tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(n)])
    return Workload("shared", prompts, output_len)


def shared_prefix(vocab_size: int, num_prompts: int = 64, prefix_len: int = 1024,
                  suffix_len: int = 32, output_len: int = 16, seed: int = 0) -> Workload:
    """num_prompts requests sharing one system prompt, each with its own suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, vocab_size) for _ in range(suffix_len)]
               for _ in range(num_prompts)]
    return Workload("shared_prefix", prompts, output_len)


def fixed(vocab_size: int, batch_size: int, input_len: int, output_len: int,
          seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(input_len)]
               for _ in range(batch_size)]
    return Workload(f"fixed_{batch_size}x{input_len}+{output_len}", prompts, output_len)


WORKLOADS = {"shared": shared_offline, "shared_prefix": shared_prefix}

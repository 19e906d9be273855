"""The GPT family used by tests, benchmarks and the CLI: ``GPT``, ``GPTConfig``, ``PRESETS``."""

from pystronghold.models.gpt import GPT, Block, GPTConfig, Head, Tail
from pystronghold.models.presets import PRESETS, block_param_count, embedding_param_count, param_count

__all__ = ["GPT", "GPTConfig", "Head", "Block", "Tail", "PRESETS", "param_count",
           "block_param_count", "embedding_param_count"]

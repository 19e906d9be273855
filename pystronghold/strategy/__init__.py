"""Whale-style strategy scopes (``replicate``, ``split``, ``stage``, ``pipeline``) and the layout
they describe. See ``scopes`` for the nesting rules and ``layout`` for the mapping to ranks; a layout
of stages runs on ``pystronghold.pipelining.gpt_pipeline_of``."""

from pystronghold.strategy.groups import init_layout
from pystronghold.strategy.layout import Layout, StageLayout, layout_of
from pystronghold.strategy.scopes import (Scope, annotate, default_strategy, pipeline, replicate,
                                          set_default_strategy, split, stage, strategy_of)

__all__ = ["Scope", "replicate", "split", "stage", "pipeline", "annotate", "strategy_of",
           "set_default_strategy", "default_strategy", "Layout", "StageLayout", "layout_of", "init_layout"]

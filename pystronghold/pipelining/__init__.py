"""Pipeline parallelism on the window runtime: each rank wraps its own stage (``pipeline.Pipeline``
on ``torch.distributed.pipelining``'s schedules), made of ``stages.PipelineStageModule``; a GPT's
balanced stages and ``gpt_pipeline`` are in ``gpt``, a Hugging Face model's in ``hf``. The arithmetic (settings and their check,
splits, pass orders) is the planner's (``planner.pipeline``); this floor sits above ``runtime``.
"""

from pystronghold.pipelining.gpt import gpt_chunks, gpt_loss, gpt_pipeline, gpt_pipeline_of, gpt_stage
from pystronghold.pipelining.hf import hf_chunks, hf_pipeline
from pystronghold.pipelining.pipeline import Pipeline
from pystronghold.pipelining.stages import PipelineChunks, PipelineStageModule, build_stage

__all__ = ["Pipeline", "PipelineStageModule", "PipelineChunks", "build_stage", "gpt_pipeline", "gpt_stage",
           "gpt_chunks", "gpt_loss", "gpt_pipeline_of", "hf_chunks", "hf_pipeline"]

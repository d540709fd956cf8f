"""Pipeline parallelism for co-training: the target split into stages, the draft on the last.

Layout, for ``pp`` ranks and ``v`` stages per rank (``pp * v`` stages)::

    stage 0                 stage 1 .. n-2          stage n-1
    embed_tokens            layers [a, b)           layers [c, L), norm, lm_head (chunked),
    layers [0, a)                                   draft (held, not a submodule), CotrainLoss
      |  taps of the layers a stage owns (and the embedding output) --TapChannel--> |

``plan`` (which layers where), ``stage`` (the stage module), ``loss`` (the last stage's half
of the co-training objective), ``build`` (settings, stages, FSDP, TapChannel, schedule),
``step_context`` (what one run of the schedule is handed), ``schedule_run`` (one update, its
clipping) and ``weight_broadcast`` (the whole models for the rollout engine). Every PP rank
gets the whole batch of host rows; each microbatch's attention metadata is prepared once per
run of the schedule and passed in with it, with the microbatch's index. Context
parallelism composes: every stage zigzag-shards its microbatch over the CP group (the same
cut on every stage), the TapChannel runs per PP column, so the taps of (stage s, CP rank c)
go to (last stage, CP rank c) already sharded. Data parallelism FSDP-shards the stages.
The draft is held by the last stage, not registered as its submodule: an FSDP root of its
own, run inside the loss (``stage.TransformerStage``). Tied embeddings (Qwen-3's small
sizes): the first and the last stage hold the same weight; its two gradient halves are
summed over a two-rank group after the step, and clipping counts it once.
"""

from titan_cotrain.parallel.pipeline.build import (
    Pipeline,
    PipelineSettings,
    build_pipeline,
    build_schedule,
    make_pipeline,
)
from titan_cotrain.parallel.pipeline.loss import CotrainLoss
from titan_cotrain.parallel.pipeline.plan import PipelinePlan, layers_per_stage_from_fqns, plan_pipeline
from titan_cotrain.parallel.pipeline.schedule_run import clip_pipeline_grad_norms, pipeline_step
from titan_cotrain.parallel.pipeline.stage import LocalPolicy, MicrobatchIndexedStage, TransformerStage
from titan_cotrain.parallel.pipeline.step_context import PipelineStepContext
from titan_cotrain.parallel.pipeline.weight_broadcast import (
    StreamedStateDict,
    broadcast_stage_weights,
    broadcast_state_dicts,
)

__all__ = [
    "CotrainLoss",
    "LocalPolicy",
    "MicrobatchIndexedStage",
    "Pipeline",
    "PipelinePlan",
    "PipelineSettings",
    "PipelineStepContext",
    "StreamedStateDict",
    "TransformerStage",
    "broadcast_stage_weights",
    "broadcast_state_dicts",
    "build_pipeline",
    "build_schedule",
    "clip_pipeline_grad_norms",
    "layers_per_stage_from_fqns",
    "make_pipeline",
    "pipeline_step",
    "plan_pipeline",
]

"""Scorers: the sources `rlkit score-ref` adds to a table, one protocol (`Scorer`, `rlkit.scorers.base`) for the
reference's and a teacher's per-token log-probs (`logprobs`), reward models (`reward_model`), LLM judges
(`judge`, their rubric kinds in `rlkit.rubrics`) and user reward functions (`reward_fns`). A scorer may use the
engines and the sampling driver; nothing below this floor imports it.
"""

from rlkit.scorers.base import (
    Rows,
    Scorer,
    clash,
    close_all,
    fields,
    inputs,
    manifest_entries,
    refuse_the_policy,
    refuse_the_sampler,
)
from rlkit.scorers.judge import JudgeScorer, parse_judges
from rlkit.scorers.logprobs import LogProbScorer, ReferenceScorer, TeacherScorer, recorded_reference
from rlkit.scorers.reward_fns import RewardFnScorer
from rlkit.scorers.reward_model import RewardModelScorer, parse_rms
from rlkit.scorers.sources import from_options, score_dtype, set_reads

__all__ = ["JudgeScorer", "LogProbScorer", "ReferenceScorer", "RewardFnScorer", "RewardModelScorer", "Rows",
           "Scorer", "TeacherScorer", "clash", "close_all", "fields", "from_options", "inputs", "manifest_entries",
           "parse_judges", "parse_rms", "recorded_reference", "refuse_the_policy", "refuse_the_sampler",
           "score_dtype", "set_reads"]

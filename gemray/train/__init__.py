"""Training: the per-worker :class:`Trainer` (one method per phase) and its Ray Train entry point.

    train_loop_per_worker(config_dict)   what each Ray Train worker runs     gemray.train.trainer
    model_data_args(cfg, manifest)       GEM's data-given arguments          gemray.train.trainer
    Trainer                              setup / build / restore / train_epoch / train_step /
                                         maybe_checkpoint / evaluate / finish
    CheckpointPolicy                     when to checkpoint (pure)           gemray.train.checkpoint_policy
    RecoveryRecorder                     the attempt's events                gemray.train.recorder
    EpochStats, ThroughputMeter          per-epoch statistics                gemray.train.stats
    PreemptionVote                       the ranks' preemption vote          gemray.train.preemption_vote
    Evaluator, RetrievalEvaluator,       per-batch metric sums               gemray.train.evaluation
    RankingEvaluator
    autocast                             train.precision -> autocast context gemray.train.precision
    TaskLosses                           per-task training losses            gemray.train.task_stats

Imports point one way: kernels <- ops <- model <- parallel <- train <- controller.
"""

from gemray.train.checkpoint_policy import CheckpointPolicy
from gemray.train.evaluation import Evaluator, RankingEvaluator, RetrievalEvaluator
from gemray.train.precision import autocast
from gemray.train.preemption_vote import PreemptionVote
from gemray.train.recorder import RecoveryRecorder
from gemray.train.stats import EpochStats, ThroughputMeter
from gemray.train.task_stats import TaskLosses
from gemray.train.trainer import Trainer, model_data_args, train_loop_per_worker

__all__ = ["CheckpointPolicy", "EpochStats", "Evaluator", "PreemptionVote", "RankingEvaluator",
           "RecoveryRecorder", "RetrievalEvaluator", "TaskLosses", "ThroughputMeter", "Trainer", "autocast",
           "model_data_args", "train_loop_per_worker"]

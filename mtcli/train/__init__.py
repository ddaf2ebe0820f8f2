"""Training: the trainer and its loop, resume, losses, schedule, validation and DDP.

``run.train(config)`` is the entry point; it may import anything below it (``infer`` for the
validation BLEU, ``model``, ``data``), and nothing below imports it.
"""

from mtcli.train.run import TrainSummary, train
from mtcli.train.trainer import Trainer

__all__ = ["TrainSummary", "Trainer", "train"]

"""``pystronghold train``: the training loop, its options, metrics, checkpoints and pictures."""

from pystronghold.train.config import TrainConfig
from pystronghold.train.loop import Trainer
from pystronghold.train.metrics import TrainResult
from pystronghold.train.run import Run, resolve

__all__ = ["TrainConfig", "Run", "resolve", "Trainer", "TrainResult"]

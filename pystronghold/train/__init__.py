"""``pystronghold train``: the training loop, its options, metrics, checkpoints and pictures."""

from pystronghold.train.config import TrainConfig
from pystronghold.train.loop import Trainer, TrainResult

__all__ = ["TrainConfig", "Trainer", "TrainResult"]

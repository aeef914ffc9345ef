"""CPU-friendly benchmark workloads, each a LightningModule with deterministic synthetic data."""

from ddlscale.workloads.cnn import ResNetCNN
from ddlscale.workloads.deepfm import DeepFM
from ddlscale.workloads.gpt import GPT
from ddlscale.workloads.lstm import LSTMLanguageModel
from ddlscale.workloads.workload import Workload

WORKLOADS: dict[str, type[Workload]] = {
    "lstm": LSTMLanguageModel,
    "deepfm": DeepFM,
    "cnn": ResNetCNN,
    "gpt": GPT,
}

__all__ = ["DeepFM", "GPT", "LSTMLanguageModel", "ResNetCNN", "WORKLOADS", "Workload"]

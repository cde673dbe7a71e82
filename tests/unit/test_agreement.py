"""overlap.agreement's signatures, single process: equal on two ranks exactly when the
settings are (the votes themselves run in tests/gloo: test_scheduler, test_diloco)."""

from __future__ import annotations

import torch
from torch import nn

from overlap.agreement import optimizer_settings, setting_signature
from overlap.compression import FP16, OneBit


def _sgd(lr: float | torch.Tensor, momentum: float = 0.9) -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr, momentum=momentum)


def test_compressors_compare_by_their_settings_not_their_identity() -> None:
    assert setting_signature(OneBit(warmup_steps=2)) == setting_signature(OneBit(warmup_steps=2))
    assert setting_signature(OneBit(warmup_steps=2)) != setting_signature(OneBit(warmup_steps=3))
    assert setting_signature(FP16()) != setting_signature(None)


def test_a_users_object_compares_by_its_class() -> None:
    class Mine:  # a repr that would differ on every rank
        def __repr__(self) -> str:
            return f"Mine at {id(self)}"

    assert setting_signature(Mine()) == setting_signature(Mine())


def test_optimizers_compare_by_hyperparameters() -> None:
    a, b = optimizer_settings(_sgd(0.7)), optimizer_settings(_sgd(0.7))
    assert setting_signature(a) == setting_signature(b)
    assert setting_signature(a) != setting_signature(optimizer_settings(_sgd(0.5)))
    assert setting_signature(a) != setting_signature(optimizer_settings(_sgd(0.7, 0.0)))
    assert optimizer_settings(None) is None


def test_a_tensor_hyperparameter_compares_by_value_not_device() -> None:
    # under NCCL each rank's tensor lr sits on its own GPU, which its repr names
    settings = optimizer_settings(_sgd(torch.tensor(0.5)))
    assert settings is not None
    text = repr(settings)
    assert "tensor0.5" in text and "device" not in text, text
    other = optimizer_settings(_sgd(torch.tensor(0.25)))
    assert setting_signature(settings) != setting_signature(other)

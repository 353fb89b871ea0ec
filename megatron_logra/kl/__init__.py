"""Predicted-KL step control: forward-mode probe of the step's KL and the step-size controller."""

from megatron_logra.kl.controller import KLConfig, KLController, KLControlError, cosine_budget

__all__ = ["KLConfig", "KLController", "KLControlError", "cosine_budget"]

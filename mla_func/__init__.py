"""mla-func: DeepSeek-style Multi-head Latent Attention inference as a pure function.

    logits, state = forward(params, state, batch, mode)
"""

from .batch import Batch, BatchError, DecodeMetadata, PrefillMetadata, build_batch, check_batch
from .checkpoint import CheckpointError, Model, load_model
from .config import ConfigError, ModelConfig, RopeConfig
from .engine import Completion, Engine, RequestError, StreamEvent
from .forward import decode, forward, prefill
from .mode import ForwardMode, PaddingPolicy
from .params import Params
from .plan import SeqPlan, StepPlan
from .presets import PRESETS
from .sampling import SamplingParams
from .state.kv_cache import DonatedStateError, KVCacheState
from .step import Step, StepOutput, make_step, padding_ladders
from .stepping import init_state, plan_step

__all__ = [
    "Batch", "BatchError", "CheckpointError", "Completion", "Engine", "RequestError", "SamplingParams", "StreamEvent", "ConfigError", "DecodeMetadata", "DonatedStateError",
    "ForwardMode", "KVCacheState", "Model", "ModelConfig", "PRESETS", "PaddingPolicy", "Params",
    "PrefillMetadata", "RopeConfig", "SeqPlan", "Step", "StepOutput", "StepPlan", "build_batch", "check_batch", "decode",
    "forward", "init_state", "load_model", "make_step", "padding_ladders", "plan_step", "prefill",
]

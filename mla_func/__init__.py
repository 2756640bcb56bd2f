"""mla-func: DeepSeek-style Multi-head Latent Attention inference as a pure function.

    logits, state = forward(params, state, batch, mode)
"""

from .batch import Batch, BatchError, DecodeMetadata, PrefillMetadata, check_batch
from .batch_build import build_batch
from .checkpoint import CheckpointError, Model, load_model
from .config import ConfigError, ModelConfig, RopeConfig
from .engine import Completion, Engine, RequestError, StreamEvent
from .families import FAMILIES, config_from_hf_dict, family_for, read_config, registry
from .family import Family
from .forward import ForwardOutput, decode, forward, forward_outputs, prefill
from .layers import LayerContext, LayerKind, layer_kinds
from .memory import NotEnoughMemory
from .mode import ForwardMode, PaddingPolicy, SegmentKind
from .params import Params
from .plan import SeqPlan, StepPlan
from .prepare import init_state, plan_step, prepare_step
from .presets import PRESETS
from .sampling import SamplingParams
from .state.kv_cache import DonatedStateError, KVCacheState
from .state.layer_cache import CacheGroup, DSALayerCache, MLALayerCache
from .step import Step, StepOutput, make_step, padding_ladders

__all__ = [
    "Batch", "BatchError", "CacheGroup", "CheckpointError", "Completion", "ConfigError", "DSALayerCache",
    "DecodeMetadata",
    "DonatedStateError", "Engine", "FAMILIES", "Family", "ForwardMode", "ForwardOutput", "KVCacheState", "LayerContext", "LayerKind",
    "MLALayerCache", "Model", "ModelConfig", "NotEnoughMemory", "PRESETS", "PaddingPolicy", "Params", "PrefillMetadata",
    "RequestError", "RopeConfig", "SamplingParams", "SegmentKind", "SeqPlan", "Step", "StepOutput", "StepPlan",
    "StreamEvent", "build_batch", "check_batch", "config_from_hf_dict", "decode", "family_for", "forward", "forward_outputs", "init_state",
    "layer_kinds", "load_model", "make_step", "padding_ladders", "plan_step", "prefill", "prepare_step", "read_config",
    "registry",
]

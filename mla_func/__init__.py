"""mla-func: DeepSeek-style Multi-head Latent Attention inference as a pure function.

    logits, state = forward(params, state, batch, mode)
"""

from mla_func.core.batch import Batch, BatchError, DecodeMetadata, PrefillMetadata, check_batch
from mla_func.core.batch_build import build_batch
from mla_func.core.config import ConfigError, ModelConfig, RopeConfig
from mla_func.core.family import Family
from mla_func.core.forward import ForwardOutput, decode, forward, forward_outputs, prefill
from mla_func.core.layers import LayerContext, LayerKind, layer_kinds
from mla_func.core.mode import ForwardMode, PaddingPolicy, SegmentKind
from mla_func.core.model import Model
from mla_func.core.params import Params
from mla_func.core.plan import SeqPlan, StepPlan
from mla_func.core.prepare import init_state, plan_step
from mla_func.core.step import Step, StepOutput, make_step, padding_ladders
from mla_func.models.load import CheckpointError, load_model
from mla_func.models.memory import NotEnoughMemory
from mla_func.models.presets import PRESETS
from mla_func.models.registry import FAMILIES, config_from_hf_dict, family_for, read_config, registry
from mla_func.parallel import Parallel
from mla_func.serving.engine import Completion, Engine, RequestError, StreamEvent
from mla_func.serving.sampling import SamplingParams
from mla_func.state.kv_cache import DonatedStateError, KVCacheState
from mla_func.state.layer_cache import CacheGroup, DSALayerCache, MLALayerCache

__all__ = [
    "Batch", "BatchError", "CacheGroup", "CheckpointError", "Completion", "ConfigError", "DSALayerCache",
    "DecodeMetadata",
    "DonatedStateError", "Engine", "FAMILIES", "Family", "ForwardMode", "ForwardOutput", "KVCacheState", "LayerContext", "LayerKind",
    "MLALayerCache", "Model", "ModelConfig", "NotEnoughMemory", "PRESETS", "PaddingPolicy", "Parallel", "Params",
    "PrefillMetadata",
    "RequestError", "RopeConfig", "SamplingParams", "SegmentKind", "SeqPlan", "Step", "StepOutput", "StepPlan",
    "StreamEvent", "build_batch", "check_batch", "config_from_hf_dict", "decode", "family_for", "forward", "forward_outputs", "init_state",
    "layer_kinds", "load_model", "make_step", "padding_ladders", "plan_step", "prefill", "read_config",
    "registry",
]

"""The `mla-func` command line: `generate` streams a completion, `bench` measures offline throughput,
`serve` runs an OpenAI-compatible server (`mla_func.server`), `quantize` converts a checkpoint folder to the block-scaled FP8 layout and back.

Every option is checked before the model loads (sampling options by building the
`SamplingParams`, the device and backend against what this machine has, drafts and
lengths against the model's config.json or preset, read without its weights), so a
mistake costs no load time. User errors print one `error:` line, without argparse's
usage block, and exit with 2; Ctrl-C prints a summary line and exits with 130
(128 + SIGINT), as shells expect.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import torch

from mla_func.checkpoint.chat_template import read_chat_template
from mla_func.checkpoint.convert import dequantize_checkpoint, quantize_checkpoint
from mla_func.checkpoint.files import CheckpointFolder
from mla_func.checkpoint.safetensors_file import read_header
from mla_func.cli.streaming import EXIT_ERROR, EXIT_INTERRUPTED, stream_completion
from mla_func.core.config import ConfigError, ModelConfig
from mla_func.core.model import Model
from mla_func.kernels import BACKENDS
from mla_func.kernels.latent_cache import KV_CACHE_DTYPES
from mla_func.models.load import load_model
from mla_func.models.presets import PRESETS, SHIPPED_PRESETS
from mla_func.models.registry import config_from_json
from mla_func.parallel.config import Parallel
from mla_func.parallel.workers import run_ranks
from mla_func.serving.engine import Engine
from mla_func.serving.sampling import SamplingParams

# One torch thread per process: on a CPU that other processes also use, torch's
# intra-op pool waits at every op for its slowest (descheduled) thread, and a single
# stream of a small model ran 10-100x slower on two threads than on one; only
# batched work on a quiet CPU gained from a second (bench/cpu.py, bench/notes/cpu.md).
DEFAULT_CPU_THREADS = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """A bad option value, found before any work starts; the message names the option."""


# A value such as -5 is an argument, not an option (none of the options looks like a number).
_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?$|-\.\d+([eE][-+]?\d+)?$")


class _Parser(argparse.ArgumentParser):
    """argparse with every mistake one `error:` line (no usage block: it hid the error below
    fourteen lines), and an unknown option answered with the closest ones this command has."""

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --threads: ..."; the CLI's own errors say "--threads: ...".
        message = message.removeprefix("argument ")
        if message.startswith(("the following arguments are required", "one of the arguments")):
            message += f"; see {self.prog} --help"
        self.exit(EXIT_ERROR, f"error: {message}\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        # Unknown arguments are refused here, by the parser they were given to: a command's
        # parser knows its own options, while the top-level one, which argparse lets refuse
        # them, knows only --help and --version.
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_arguments(extras))
        return parsed, extras

    def unknown_arguments(self, extras: list[str]) -> str:
        """The error of arguments this parser has no place for: each unknown option with the
        closest known ones, or else the stray values."""
        flags = [a.split("=", 1)[0] for a in extras if a.startswith("-") and not _NUMBER.match(a)]
        if not flags:
            return f"unexpected argument{'s' if len(extras) > 1 else ''} {' '.join(extras)!r}; see {self.prog} --help"
        return "; ".join(self.unknown_option(flag) for flag in flags)

    def unknown_option(self, flag: str) -> str:
        # self._option_string_actions is argparse's own table of this parser's option strings. They
        # are compared without their dashes, which every one shares: with them, --seeds was "close" to --threads.
        options = {option.lstrip("-"): option for option in self._option_string_actions}
        close = difflib.get_close_matches(flag.lstrip("-"), list(options), n=3)
        if not close:
            return f"unknown option {flag}; see {self.prog} --help"
        return f"unknown option {flag}: did you mean {_or([options[name] for name in close])}?"


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True, slots=True)
class SamplingOption:
    """A `generate` option that sets one `SamplingParams` field (a bool field is an on/off flag)."""

    flag: str
    field: str
    type: type
    default: Any
    help: str


# `generate`'s sampling options, in --help order; their defaults are the CLI's, not SamplingParams'.
SAMPLING_OPTIONS: tuple[SamplingOption, ...] = (
    SamplingOption("--max-tokens", "max_tokens", int, 64, "most tokens to generate"),
    SamplingOption("--temperature", "temperature", float, 0.8, "0 = greedy"),
    SamplingOption("--top-k", "top_k", int, 0, "keep the k most likely tokens; 0 = off"),
    SamplingOption("--top-p", "top_p", float, 1.0, "keep the most likely tokens up to this probability; 1 = off"),
    SamplingOption("--seed", "seed", int, None,
                   "sampling seed (default: a fresh random seed each run, shown in the summary line)"),
    SamplingOption("--ignore-eos", "ignore_eos", bool, False, "keep generating after the end-of-sequence token"),
    SamplingOption("--repetition-penalty", "repetition_penalty", float, 1.0,
                   "divide positive / multiply negative logits of prompt and output tokens; 1 = off"),
    SamplingOption("--presence-penalty", "presence_penalty", float, 0.0,
                   "subtract from the logits of tokens already generated; 0 = off"),
    SamplingOption("--frequency-penalty", "frequency_penalty", float, 0.0,
                   "subtract once per time a token was generated; 0 = off"),
    SamplingOption("--min-tokens", "min_tokens", int, 0, "no end-of-sequence or stop token before this many tokens"),
    # A tuple field: the option may be repeated, each time adding one string.
    SamplingOption("--stop", "stop", tuple, (),
                   "stop before this text, which is not printed (repeat for several, at most 16; default: none)"),
    SamplingOption("--n", "n", int, 1, "samples of the prompt: the first streams, the others follow it"),
    SamplingOption("--logprobs", "logprobs", int, None,
                   "after the text, each generated token's logprob and this many likeliest alternatives (0 to 20)"),
    SamplingOption("--prompt-logprobs", "prompt_logprobs", int, None,
                   "after the text, each prompt token's logprob and this many likeliest alternatives (0 to 20)"),
)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        shown = "off" if action.nargs == 0 and action.default is False else "%(default)s"
        return f"{text} (default: {shown})"


def fresh_seed() -> int:
    """A seed from the operating system's randomness, for a run without --seed.

    The engine's own per-request seeds come from a generator it seeds with 0, so leaving
    the seed to it would sample the same text on every run. 32 bits keep it short to
    copy from the summary line into --seed.
    """
    return secrets.randbits(32)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` of `generate`'s options, with a fresh seed unless --seed gives one;
    UsageError naming the option if one is invalid."""
    values = {o.field: getattr(args, o.field) for o in SAMPLING_OPTIONS}
    for o in SAMPLING_OPTIONS:
        if o.type is tuple:  # an option never given is None (argparse's append would grow a shared default)
            values[o.field] = tuple(values[o.field] or o.default)
    if values["seed"] is None:
        values["seed"] = fresh_seed()
    try:
        return SamplingParams(**values)
    except ValueError as e:
        flag = next((o.flag for o in SAMPLING_OPTIONS if f"SamplingParams.{o.field} " in str(e)), "sampling option")
        raise UsageError(f"{flag}: {e}") from None


def resolve_device(name: str | None) -> torch.device:
    """The --device value, checked against this machine (default: cuda when available, else cpu)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise UsageError(f"--device {name}: CUDA is not available ({why}); available: cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda, got {name!r}")
    return device


def available_backends(device: torch.device) -> list[str]:
    """The kernel backends that can run on `device` here.

    Triton kernels need a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1,
    which runs them on CPU tensors, slowly); AITER needs ROCm's `aiter` package.
    """
    found = ["torch"]
    if importlib.util.find_spec("triton") is not None and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        found.append("triton")
    if device.type == "cuda" and torch.version.hip is not None and importlib.util.find_spec("aiter") is not None:
        found.append("aiter")
    return found


def check_backend(backend: str | None, device: torch.device) -> None:
    available = available_backends(device)
    if backend is None or backend in available:
        return
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        why = "Triton is not installed (pip install 'mla-func[triton]')"
    elif backend == "triton":
        why = "its kernels need a CUDA GPU (or TRITON_INTERPRET=1 for Triton's slow CPU interpreter)"
    else:
        why = "it needs ROCm and its aiter package"
    raise UsageError(f"--backend {backend}: not available on {device} here: {why}; available: {', '.join(available)}")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="checkpoint folder or preset name")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="weight dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="kernels (default: triton on cuda, torch elsewhere)")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly, without CUDA graphs")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the latent cache: auto (the weight dtype) or fp8 (FP8 latents with a scale per 128, "
                             "RoPE values in the weight dtype; not for DeepSeek-V4 models)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="batch-invariant steps: a request's tokens do not depend on what else runs, "
                             "drafts included (slower on a GPU; not for DeepSeek-V4 models)")
    parser.add_argument("--w8a8", action="store_true",
                        help="an FP8 checkpoint's products quantize their activations per token and group of 128 "
                             "and multiply FP8 by FP8, as its 'dynamic' activation scheme says (default: the "
                             "activations as they are, times the dequantized weights)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help=f"torch CPU threads (default: {DEFAULT_CPU_THREADS} on cpu; torch's own choice on cuda)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _add_draft_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-tokens", type=_draft_count, default=0,
                        help="tokens drafted a step by the model's MTP layer and verified in one step, 1 to 8 "
                             "(0 = off; the summary line then reports the acceptance rate)")


def _draft_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 8], got {text!r}") from None
    if not 0 <= value <= 8:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 8], got {value}")
    return value


def prepare(args: argparse.Namespace) -> torch.device:
    """Check the model options and apply the thread policy; returns the device to load on."""
    device = resolve_device(args.device)
    check_backend(args.backend, device)
    threads = args.threads or (DEFAULT_CPU_THREADS if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    return device


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What `load_model(name)` will load, known without reading a weight: its config, and the
    checkpoint folder it reads (None for a shape preset, whose random weights include an MTP layer)."""

    name: str
    config: ModelConfig
    folder: CheckpointFolder | None


def model_source(name: str) -> ModelSource | None:
    """--model's config, from its config.json or preset, resolved as `load_model` resolves the name
    (a folder of a preset's name wins); None where there is no config.json to read, which load_model
    refuses with its own error (no such folder or preset, the list of presets)."""
    path = Path(name)
    if not path.exists() and name in PRESETS:
        return ModelSource(name, PRESETS[name](), None)
    if not path.exists() and name in SHIPPED_PRESETS:
        path = SHIPPED_PRESETS[name]
    if not (path / "config.json").is_file():
        return None
    folder = CheckpointFolder.at(path)
    config = config_from_json(folder.read_json("config.json", error=ConfigError), folder.label("config.json"))
    return ModelSource(name, config, folder)


_INDEX = "model.safetensors.index.json"


def tensor_names(folder: CheckpointFolder) -> list[str] | None:
    """A checkpoint folder's tensor names, from its index or else its shards' headers (no tensor
    is read); None where the folder does not show them plainly (a malformed index, no shards),
    which the loader then reports."""
    if folder.has(_INDEX):
        index = folder.read_json(_INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        return list(weight_map) if isinstance(weight_map, dict) else None
    shards = [file for file in folder.names() if file.endswith(".safetensors")]
    if not shards:
        return None
    names: list[str] = []
    for file in shards:
        with folder.open(file) as handle:
            names.extend(read_header(handle, folder.label(file)))
    return names


def check_drafts(source: ModelSource, speculative_tokens: int) -> None:
    """Refuse --speculative-tokens for a model without a multi-token-prediction layer to draft with,
    by the flag: loading it with mtp=True would fail on a tensor list or a Python argument."""
    if not speculative_tokens:
        return
    flag = f"--speculative-tokens {speculative_tokens}"
    mtp = source.config.family.mtp
    if mtp is None:
        raise UsageError(f"{flag}: {source.name} is a {source.config.family.title} model, whose multi-token-prediction "
                         "(MTP) layers are not supported yet; run it without --speculative-tokens")
    if source.folder is None:
        return
    # The tensors decide whether a checkpoint holds its MTP layer: transformers' DeepseekV3Config
    # says num_nextn_predict_layers 1 even where save_pretrained wrote no such layer.
    prefix = mtp.prefix(source.config)
    names = tensor_names(source.folder)
    if names is not None and not any(name.startswith(prefix) for name in names):
        raise UsageError(f"{flag} needs a checkpoint with a multi-token-prediction (MTP) layer, and "
                         f"{source.name} has none (no {prefix}* tensors); run it without --speculative-tokens")


def check_invariance(source: ModelSource, batch_invariant: bool) -> None:
    """Refuse --batch-invariant for a model without batch-invariant ops, by the flag, before the load."""
    if batch_invariant and not source.config.family.supports_batch_invariant:
        raise UsageError(f"--batch-invariant: {source.name} is a {source.config.family.title} model, whose layers "
                         "have no batch-invariant ops yet; run it without --batch-invariant")


def check_cache_dtype(source: ModelSource, kv_cache_dtype: str) -> None:
    """Refuse --kv-cache-dtype fp8 for a model without an FP8 latent cache, by the flag, before the load."""
    if kv_cache_dtype == "fp8" and source.config.family.fp8_cache_layer_kinds is None:
        raise UsageError(f"--kv-cache-dtype fp8: {source.name} is a {source.config.family.title} model, whose caches "
                         "have no FP8 form yet; run it with --kv-cache-dtype auto")


def check_w8a8(source: ModelSource, w8a8: bool, batch_invariant: bool) -> None:
    """Refuse --w8a8 for a model without FP8 weights, or with --batch-invariant, by the flag, before the load."""
    if not w8a8:
        return
    if batch_invariant:
        raise UsageError("--w8a8 with --batch-invariant: the batch-invariant steps multiply FP8 weights by 16-bit "
                         "activations; run without one of them")
    if source.folder is None:
        raise UsageError(f"--w8a8: {source.name} is a shape preset, whose random weights are not FP8; give an FP8 "
                         "checkpoint folder (`mla-func quantize SRC DST` writes one), or run it without --w8a8")
    if source.folder.read_json("config.json", error=ConfigError).get("quantization_config") is None:
        raise UsageError(f"--w8a8: {source.name} has no FP8 weights (its config.json has no quantization_config); "
                         "`mla-func quantize SRC DST` writes an FP8 copy, or run it without --w8a8")


def check_bench_lengths(args: argparse.Namespace, config: ModelConfig) -> None:
    """Refuse prompts and outputs longer than the model runs, before the load and the warm-up."""
    longest = args.max_input_len + args.output_len
    if longest > config.max_position_embeddings:
        raise UsageError(
            f"--max-input-len {args.max_input_len} + --output-len {args.output_len} = {longest} tokens, over "
            f"the model's maximum length {config.max_position_embeddings} ({args.model}'s max_position_embeddings)"
        )


def check_model(args: argparse.Namespace) -> ModelSource | None:
    """The model's config and drafts, checked before the load; None as for `model_source`."""
    source = model_source(args.model)
    if source is not None:
        check_drafts(source, args.speculative_tokens)
        check_invariance(source, args.batch_invariant)
        check_cache_dtype(source, args.kv_cache_dtype)
        check_w8a8(source, args.w8a8, args.batch_invariant)
    return source


def load(args: argparse.Namespace, device: torch.device, say: Callable[[str], None],
         parallel: Parallel | None = None) -> Model:
    started = time.perf_counter()
    say(f"loading {args.model} on {device}")
    model = load_model(args.model, dtype=_DTYPES[args.dtype] if args.dtype else None, device=device,
                       mtp=args.speculative_tokens > 0, parallel=parallel)
    say(f"loaded in {time.perf_counter() - started:.1f} s")
    return model


def read_prompt(text: str) -> str:
    """The prompt argument; "-" reads it from standard input (without the final newline a file or echo ends with)."""
    if text != "-":
        return text
    prompt = sys.stdin.read().removesuffix("\n").removesuffix("\r")
    if not prompt:
        raise UsageError("the prompt read from standard input (prompt '-') is empty")
    return prompt


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """--chat's messages (a --system message first), or None for a plain prompt (argparse takes exactly one)."""
    if args.chat is None:
        if args.system is not None:
            raise UsageError("--system needs --chat (a plain prompt goes to the model as it is)")
        return None
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    return [*system, {"role": "user", "content": args.chat}]


def check_chat_template(source: ModelSource | None, name: str) -> None:
    """--chat needs the model's chat template: checked from its folder before the load (None: load_model's error)."""
    if source is None:
        return
    template = read_chat_template(source.folder) if source.folder is not None else None
    if template is None:
        where = "a shape preset with random weights" if source.folder is None else str(source.folder.root)
        raise UsageError(f"--chat: model {name} ({where}) has no chat template (tokenizer_config.json "
                         "'chat_template' or chat_template.jinja); give a plain PROMPT")


def _add_parallel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="N",
                        help="split the model across N processes of this host (one GPU each on cuda); only the "
                             "first prints (see README 'Several GPUs')")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tensor-parallel: each rank holds 1/N of the routed experts whole instead of "
                             "1/N of every expert's columns")
    parser.add_argument("--data-parallel-attention", action="store_true",
                        help="with --tensor-parallel: each rank attends for its own requests with every head, "
                             "over a latent cache of its own; the MLPs and experts stay split")


def check_parallel(args: argparse.Namespace) -> None:
    """--expert-parallel and --data-parallel-attention cut the model across ranks: they need
    --tensor-parallel N >= 2 (UsageError naming them otherwise); N ranks on CUDA need N visible GPUs, one
    each in order (a --device naming one GPU is refused)."""
    asked = [flag for flag, on in (("--expert-parallel", args.expert_parallel),
                                   ("--data-parallel-attention", args.data_parallel_attention)) if on]
    if asked and args.tensor_parallel < 2:
        raise UsageError(f"{' and '.join(asked)} {'needs' if len(asked) == 1 else 'need'} --tensor-parallel N >= 2 "
                         f"(ranks to split the model across), got --tensor-parallel {args.tensor_parallel}")
    device = resolve_device(args.device) if args.tensor_parallel > 1 else None
    if device is not None and device.type == "cuda":
        # Checked here, before any rank starts: a rank whose GPU is missing would fail only once it runs.
        if device.index is not None:
            raise UsageError(f"--device {args.device} with --tensor-parallel {args.tensor_parallel}: rank r takes "
                             "GPU r of those visible; pass --device cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
        count = torch.cuda.device_count()
        if count < args.tensor_parallel:
            raise UsageError(f"--tensor-parallel {args.tensor_parallel}: one GPU a rank, and {count} CUDA "
                             f"device{'s are' if count != 1 else ' is'} visible; ask for at most {count} ranks "
                             "(or --device cpu)")


def rank_parallel(args: argparse.Namespace, parallel: Parallel) -> Parallel:
    """This rank's `Parallel` (from `run_ranks`), cut as --expert-parallel / --data-parallel-attention ask."""
    return replace(parallel, expert_parallel=args.expert_parallel, data_parallel_attention=args.data_parallel_attention)


def rank_device(device: torch.device, parallel: Parallel | None) -> torch.device:
    """A rank's own GPU (cuda:rank) when the model is split across ranks on CUDA; else `device`."""
    if parallel is None or parallel.tensor_parallel == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", parallel.rank)


def generate_main(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    messages = chat_messages(args)
    prompt: str | list[dict[str, str]] = read_prompt(args.prompt) if messages is None else messages
    check_parallel(args)
    # Read and drawn once, here: every rank must run the same prompt with the same seed.
    if args.tensor_parallel > 1:
        return run_ranks(args.tensor_parallel, _generate_rank, (args, params, prompt))
    return _generate(args, params, prompt, None)


def _generate_rank(payload: tuple[argparse.Namespace, SamplingParams, Any], parallel: Parallel) -> int:
    args, params, prompt = payload
    return _generate(args, params, prompt, rank_parallel(args, parallel))


def _generate(args: argparse.Namespace, params: SamplingParams, prompt: str | list[dict[str, str]],
              parallel: Parallel | None) -> int:
    device = rank_device(prepare(args), parallel)
    source = check_model(args)
    if args.chat is not None:
        check_chat_template(source, args.model)
    model = load(args, device, say=lambda msg: None, parallel=parallel)
    engine = Engine(model, backend=args.backend, graphs=not args.no_graphs, max_num_seqs=params.n,
                    max_num_batched_tokens=max(512, params.max_tokens), speculative_tokens=args.speculative_tokens,
                    batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype, w8a8=args.w8a8)
    return stream_completion(engine, prompt, params, out=sys.stdout, err=sys.stderr)


def bench_main(args: argparse.Namespace) -> int:
    if args.min_input_len > args.max_input_len:
        raise UsageError(f"--min-input-len {args.min_input_len} is above --max-input-len {args.max_input_len}")
    check_parallel(args)
    if args.tensor_parallel > 1:
        return run_ranks(args.tensor_parallel, _bench_rank, args)
    return _bench(args, None)


def _bench_rank(args: argparse.Namespace, parallel: Parallel) -> int:
    return _bench(args, rank_parallel(args, parallel))


def _bench(args: argparse.Namespace, parallel: Parallel | None) -> int:
    from mla_func.serving.benchmark import run_throughput

    device = rank_device(prepare(args), parallel)
    source = check_model(args)
    if source is not None:
        check_bench_lengths(args, source.config)

    def say(msg: str) -> None:
        sys.stderr.write(f"[bench] {msg}\n")  # one write a line (see `server.engine_process._say`)
        sys.stderr.flush()

    model = load(args, device, say, parallel=parallel)
    result = run_throughput(
        model, num_prompts=args.num_prompts, input_len=(args.min_input_len, args.max_input_len),
        output_len=args.output_len, backend=args.backend, graphs=not args.no_graphs,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, say=say,
        speculative_tokens=args.speculative_tokens, batch_invariant=args.batch_invariant,
        kv_cache_dtype=args.kv_cache_dtype, w8a8=args.w8a8,
    )
    print(
        f"{result['num_prompts']} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens "
        f"in {result['seconds']:.2f} s: {result['output_tok_s']:.1f} output tokens/s, "
        f"{result['total_tok_s']:.1f} total tokens/s"
        + (f", acceptance rate {result['acceptance_rate']:.0%}" if args.speculative_tokens else "")
    )
    print("time to first token p50/p90/p99 {ttft_ms_p50:.1f}/{ttft_ms_p90:.1f}/{ttft_ms_p99:.1f} ms, "
          "inter-token latency p50/p90/p99 {itl_ms_p50:.1f}/{itl_ms_p90:.1f}/{itl_ms_p99:.1f} ms".format(**result))
    print("cache: {cache_bytes_per_token:,.0f} bytes a token at {cache_context} tokens; {cache_bytes:,} bytes of "
          "blocks hold one sequence of up to {cache_longest_context} tokens, or {cache_sequences} of "
          "{cache_context}".format(**result))
    return 0


def serve_main(args: argparse.Namespace) -> int:
    missing = [name for name in ("starlette", "uvicorn", "pydantic", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serve needs {', '.join(missing)}: pip install 'mla-func[serve]'")
    from mla_func.server.engine_process import EngineRecipe, EngineStartError
    from mla_func.server.serve import Listen, serve

    check_parallel(args)
    if args.engine_thread and args.tensor_parallel > 1:
        raise UsageError(f"--engine-thread: the engine of --tensor-parallel {args.tensor_parallel} runs in "
                         f"{args.tensor_parallel} processes of its own; drop one of the two")
    device = prepare(args)
    source = check_model(args)
    if source is not None and args.max_model_len is not None \
            and args.max_model_len > source.config.max_position_embeddings:
        raise UsageError(f"--max-model-len {args.max_model_len}: over the model's maximum length "
                         f"{source.config.max_position_embeddings} ({args.model}'s max_position_embeddings)")

    def say(msg: str) -> None:
        sys.stderr.write(f"[serve] {msg}\n")  # one write a line (see `server.engine_process._say`)
        sys.stderr.flush()

    # prepare() set the thread policy in this process; the engine's process applies the same.
    recipe = EngineRecipe(
        model=args.model, device=str(device), dtype=_DTYPES[args.dtype] if args.dtype else None,
        threads=torch.get_num_threads() if args.threads or device.type == "cpu" else None,
        engine_kwargs=dict(backend=args.backend, graphs=not args.no_graphs, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                           batch_invariant=args.batch_invariant, speculative_tokens=args.speculative_tokens,
                           seed=args.seed, kv_cache_dtype=args.kv_cache_dtype, w8a8=args.w8a8),
        tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel,
        data_parallel_attention=args.data_parallel_attention)
    listen = Listen(model_name=args.served_model_name or args.model, host=args.host, port=args.port,
                    max_waiting=args.max_waiting, request_timeout_s=args.request_timeout,
                    shutdown_timeout_s=args.shutdown_timeout)
    try:
        serve(recipe.build(say) if args.engine_thread else recipe, listen, say, start_timeout_s=args.start_timeout)
    except EngineStartError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    return 0


def _in_range(convert: Callable[[str], float], low: float, high: float, expected: str,
              *, open_low: bool = False) -> Callable[[str], Any]:
    """An argparse type: `convert(text)` within [low, high] (above low when `open_low`), else an error
    saying `expected`."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (low < value if open_low else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


_port = _in_range(int, 1, 65535, "a port in [1, 65535]")
_seconds = _in_range(float, 0, sys.float_info.max, "seconds > 0", open_low=True)
_count = _in_range(int, 0, float("inf"), "an int >= 0")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server", formatter_class=_DefaultsFormatter,
                                description="Serve the model over OpenAI's API (/v1/completions, "
                                            "/v1/chat/completions, /v1/models) with /health and /metrics, "
                                            "until SIGTERM or Ctrl-C.")
    _add_model_args(serve)
    _add_parallel_arg(serve)
    _add_draft_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the name requests give as 'model' (default: the --model value)")
    serve.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most requests in one step")
    serve.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="most tokens in one step")
    serve.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest prompt + output, in tokens (default: the model's maximum)")
    serve.add_argument("--max-waiting", type=_count, default=256,
                       help="requests that may wait beyond the running ones; more are answered 429")
    serve.add_argument("--request-timeout", type=_seconds, default=600.0,
                       help="seconds a request may take before it is aborted (answered 504)")
    serve.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                       help="on SIGTERM, seconds open requests may take to finish before they are aborted")
    serve.add_argument("--seed", type=int, default=0, help="seed of the per-request seeds of unseeded requests")
    serve.add_argument("--start-timeout", type=_seconds, default=1800.0,
                       help="seconds the engine's process may take to load the model and warm up")
    serve.add_argument("--engine-thread", action="store_true",
                       help="run the engine on a thread of the server's process instead of a process of its own "
                            "(one GIL for both: slower under load)")
    serve.set_defaults(run=serve_main)


def quantize_main(args: argparse.Namespace) -> int:
    if args.dtype is not None and not args.dequantize:
        raise UsageError("--dtype applies to --dequantize only (quantizing writes float8_e4m3fn weights)")
    src, dst = Path(args.src), Path(args.dst)
    if not (src / "config.json").is_file():
        raise UsageError(f"SRC {args.src}: not a checkpoint folder (no config.json)")
    # The converters check the rest (the destination, quantization_config, the tensors) before writing.
    if args.dequantize:
        dequantize_checkpoint(src, dst, dtype=_DTYPES[args.dtype or "bfloat16"], progress=True)
    else:
        quantize_checkpoint(src, dst, progress=True)
    print(f"{'dequantized' if args.dequantize else 'quantized'} {args.src} -> {args.dst}")
    return 0


def _version() -> str:
    try:
        version = metadata.version("mla-func")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    return f"mla-func {version} (torch {torch.__version__}, {cuda})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mla-func", description="DeepSeek-style MLA inference.", formatter_class=_DefaultsFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="stream a completion of a prompt", formatter_class=_DefaultsFormatter,
                              description="Stream a completion of PROMPT, then print a summary line on stderr.")
    # PROMPT or --chat, exactly one: argparse refuses neither and both, each in one line.
    prompt_or_chat = gen.add_mutually_exclusive_group(required=True)
    prompt_or_chat.add_argument("prompt", nargs="?", default=None,
                                help="the text to continue ('-' reads it from standard input; token ids such as "
                                     "'1 2 3' for a model without a tokenizer)")
    prompt_or_chat.add_argument("--chat", default=None, metavar="MESSAGE",
                                help="a user message, sent through the model's chat template instead of a prompt")
    gen.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before it")
    _add_model_args(gen)
    _add_parallel_arg(gen)
    _add_draft_arg(gen)
    for option in SAMPLING_OPTIONS:
        if option.type is bool:
            gen.add_argument(option.flag, dest=option.field, action="store_true", help=option.help)
        elif option.type is tuple:
            gen.add_argument(option.flag, dest=option.field, action="append", default=None, metavar="STR",
                             help=option.help)
        else:
            gen.add_argument(option.flag, dest=option.field, type=option.type, default=option.default,
                             help=option.help)
    gen.set_defaults(run=generate_main)

    bench = commands.add_parser("bench", help="offline throughput on random prompts", formatter_class=_DefaultsFormatter,
                                description="Generate --output-len tokens (greedy, no early stop) for each of "
                                            "--num-prompts random prompts; print the throughput.")
    _add_model_args(bench)
    _add_parallel_arg(bench)
    bench.add_argument("--num-prompts", type=_positive_int, default=64, help="requests")
    bench.add_argument("--min-input-len", type=_positive_int, default=32, help="shortest prompt, in tokens")
    bench.add_argument("--max-input-len", type=_positive_int, default=128, help="longest prompt, in tokens")
    bench.add_argument("--output-len", type=_positive_int, default=32, help="tokens generated per request")
    bench.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most requests in one step")
    bench.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="most tokens in one step")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    _add_draft_arg(bench)
    bench.set_defaults(run=bench_main)

    _add_serve_parser(commands)

    quantize = commands.add_parser("quantize", help="convert a checkpoint folder to block-scaled FP8, or back",
                                   formatter_class=_DefaultsFormatter,
                                   description="Write SRC's weights to DST in DeepSeek's released FP8 layout "
                                               "(float8_e4m3fn values with a float32 scale per 128 x 128 block), "
                                               "or with --dequantize back to float weights.")
    quantize.add_argument("src", help="the checkpoint folder to read")
    quantize.add_argument("dst", help="the folder to write (must not exist, or be empty)")
    quantize.add_argument("--dequantize", action="store_true", help="read an FP8 checkpoint, write float weights")
    quantize.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                          help="the dtype of dequantized weights (default: bfloat16; --dequantize only)")
    quantize.set_defaults(run=quantize_main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

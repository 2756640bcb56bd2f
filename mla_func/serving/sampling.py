"""Seeded token sampling on the device, in one batched computation with no host sync.

Randomness is an explicit key, as in JAX: the noise for row i and vocab entry v
is a counter-based hash of (seeds[i], positions[i], v). A row's token therefore
depends only on its own logits, sampling settings, seed and position, never on
its batch-mates, their order, the batch size or how many steps ran before. (The
logits themselves are batch-invariant only in batch-invariant steps:
`Engine(batch_invariant=True)`, README "Batch invariance".)

Seeds: a request with `SamplingParams.seed` set uses it; for one without, the
caller draws a seed once when the request arrives (`request_seed`) and keeps it
for every step of that request, so a preempted and recomputed request, or a
replayed step, samples the same tokens.
"""

from __future__ import annotations

import math
import random
import reprlib
from dataclasses import dataclass

import torch

from mla_func.kernels.checks import as_dtype
from mla_func.kernels.ops import Ops
from mla_func.kernels.reference.sampling import MIN_TEMPERATURE, uniform_noise
from mla_func.kernels.reference.table import REFERENCE

# The noise and the greedy threshold live beside the draw op (`mla_func.kernels.reference.sampling`),
# which every backend's kernel matches bit for bit; they are re-exported here for callers.
__all__ = ["MIN_TEMPERATURE", "SamplingParams", "describe", "request_seed", "sample", "uniform_noise"]


class _BoundedRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # Python refuses (ValueError) to print an int of more than 4300 digits.
        return repr(x) if x.bit_length() <= 64 else f"<an int of {x.bit_length()} bits>"


def describe(value: object) -> str:
    """A short repr of any value for an error message: long containers and strings cut, huge ints sized."""
    return _BoundedRepr().repr(value)


MAX_STOP_STRINGS = 16  # `SamplingParams.stop`: each is searched in every new piece of text
MAX_CHOICES = 16  # `SamplingParams.n`: samples of one prompt, each its own request
MAX_LOGPROBS = 20  # `SamplingParams.logprobs`: top alternatives per token, as OpenAI's API allows


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float that is finite (a huge int is finite too: it is compared, never converted)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return isinstance(x, int) or math.isfinite(x)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples.

    temperature:        0 means greedy (argmax); default 1.0 samples from the model's distribution.
                        Below MIN_TEMPERATURE (1e-5) it is greedy too.
    top_p:              keep the smallest set of most likely tokens whose probability reaches top_p; 1 = off.
    top_k:              keep the k most likely tokens; 0 = off (any k >= the vocabulary is off too).
    max_tokens:         most tokens to generate.
    min_tokens:         stop tokens and end-of-sequence cannot be sampled before this many tokens; 0 = off.
    seed:               in [0, 2**63); None means the caller draws one per request (`request_seed`).
    stop_token_ids:     sampling one of these stops the request (it is kept in the output).
    ignore_eos:         do not stop at the tokenizer's end-of-sequence token.
    repetition_penalty: > 0; a token of the prompt or the output has its logit divided by it where
                        positive and multiplied where negative (CTRL, as in transformers); 1 = off.
    presence_penalty:   subtracted once from the logit of every token already in the output; 0 = off.
    frequency_penalty:  subtracted from a token's logit once per time it is in the output; 0 = off.
                        (Both additive penalties as in OpenAI's API: negative values encourage repeats.)
    stop:               up to 16 non-empty strings (a list is accepted and kept as a tuple); when the
                        generated text contains one, the request finishes with reason "stop". As in
                        OpenAI's API and vLLM, the completion's text ends just before the stop string
                        (which is not included), and its token ids run up to and including the token
                        that completed it. Found across token boundaries; needs the model's tokenizer.
    logprobs:           None (off) or 0..20: the completion then carries, per generated token, its
                        logprob and that many top alternatives (`Completion.logprobs`). They are of the
                        model's distribution after penalties and min_tokens, before temperature, top-k
                        and top-p (as OpenAI's: the model's own probabilities, whatever the sampling).
    prompt_logprobs:    None (off) or 0..20: the completion then carries, for every prompt token after the
                        first, its logprob given the tokens before it and that many top alternatives
                        (`Completion.prompt_logprobs`, None at position 0). They come from one scoring
                        pass over the prompt (`Engine.score`: a prefill in borrowed free cache blocks)
                        before the request is queued, so they cost one more prefill of the prompt.
    n:                  1 to 16 samples of the prompt, each its own request with its own seed
                        (`requests.choice_seed`: the first the request's seed, the others derived from it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        def bad(field_name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{field_name} {why}, got {describe(getattr(self, field_name))}")

        if not _is_real(self.temperature) or not 0 <= self.temperature <= 1e6:
            bad("temperature", "must be a finite number >= 0 (and <= 1e6)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an int >= 0 (0 = off)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 63):
            bad("seed", "must be None or an int in [0, 2**63)")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(x) and x >= 0 for x in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a tuple of ints >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        # Bounded so that penalised float32 logits stay finite (|logit| * 1e6 and counts * 1e6 are).
        if not _is_real(self.repetition_penalty) or not 1e-6 <= self.repetition_penalty <= 1e6:
            bad("repetition_penalty", "must be a number in [1e-6, 1e6] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -1e6 <= value <= 1e6:
                bad(name, "must be a number in [-1e6, 1e6] (0 = off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an int in [0, max_tokens={describe(self.max_tokens)}]")
        if isinstance(self.stop, list):
            # Frozen: normalise the list a caller (or JSON) gives to the tuple the field holds.
            object.__setattr__(self, "stop", tuple(self.stop))
        if (not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in self.stop)):
            bad("stop", f"must be a tuple or list of at most {MAX_STOP_STRINGS} non-empty strings")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            bad("n", f"must be an int in [1, {MAX_CHOICES}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be None (off) or an int in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def request_seed(params: SamplingParams, rng: random.Random) -> int:
    """The seed a request samples with: its own, or one drawn from `rng` (call once per request)."""
    return params.seed if params.seed is not None else rng.getrandbits(63)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    use_top_k_top_p: bool = True,
    ops: Ops | None = None,
) -> torch.Tensor:
    """Sample one token per row; greedy, temperature, top-k and top-p, no host sync.

    logits      [N, V] float (any float dtype; computed in float32)
    temperature [N] float: below MIN_TEMPERATURE (0 included) = greedy (argmax of the raw logits)
    top_k       [N] int: 0 (or >= V) = off
    top_p       [N] float in (0, 1]: 1 = off
    seeds       [N] int64, positions [N] int64: the random key of each row
                (position: the index the sampled token will have in its sequence,
                or any per-step counter the caller keeps consistent)
    ops         the op table whose `sampling.gumbel_max` draws (default: the reference's);
                every backend's draw gives the same tokens
    returns     [N] int64 token ids

    Top-k is applied before top-p, both on the temperature-scaled distribution.
    Tokens tied with the last kept one are kept too. The draw is Gumbel-max:
    argmax(logits / T + g) with g = -log(-log(u)) samples softmax(logits / T).
    `use_top_k_top_p=False` skips the sort when the caller knows every row has
    top_k = 0 and top_p = 1 (a host-side fact, so no sync): the whole draw is then
    the one `gumbel_max` op (a single launch on the Triton backend).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    per_row = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seeds": seeds, "positions": positions}
    for name, t in per_row.items():
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape [{n}] to match logits, got {tuple(t.shape)}")
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    draw = (ops or REFERENCE).sampling.gumbel_max
    if temperature.dtype != torch.float32:
        # The draw takes float32 temperatures: decide greediness in the caller's dtype first, so a
        # temperature that rounds across MIN_TEMPERATURE keeps the decision it was given.
        temperature = torch.where(temperature < MIN_TEMPERATURE, 0.0, temperature.float())
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits = logits.float()
    if not use_top_k_top_p:
        return draw(logits, temperature, seeds, positions)

    logits = as_dtype(logits, torch.float32)
    greedy = temperature < MIN_TEMPERATURE  # [N]
    # Greedy rows are divided by 1 so they stay finite.
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # [N, V]
    sorted_logits, _ = scaled.sort(dim=-1, descending=True)  # [N, V]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).long()  # [N]
    ranks = torch.arange(vocab, device=logits.device)  # [V]
    in_top_k = ranks[None, :] < k[:, None]  # [N, V]
    probs = torch.softmax(sorted_logits.masked_fill(~in_top_k, -math.inf), dim=-1)  # [N, V]
    # A token is in the nucleus if the mass strictly before it is below top_p (the first always is).
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p.float()[:, None]) & in_top_k  # [N, V], a prefix of each row
    num_keep = keep.sum(dim=-1).clamp(min=1)  # [N]
    threshold = sorted_logits.gather(1, (num_keep - 1)[:, None])  # [N, 1]
    scaled = scaled.masked_fill(scaled < threshold, -math.inf)
    # The same draw on the already scaled rows at temperature 1 (dividing by 1 is exact). A greedy
    # row (temperature 0) takes the argmax of its raw logits: its maximum is always kept, and what
    # the filter drops became -inf, below it.
    return draw(scaled, torch.where(greedy, 0.0, 1.0), seeds, positions)

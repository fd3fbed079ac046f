"""The arguments of generate(), checked once, with Hugging Face's names, meanings and defaults; and
the decoding defaults of every caller, stated here once.

    DEFAULTS         generate() / stream() / beam search: Hugging Face's
    TEXT_DEFAULTS    `tformer generate` and the LM task's progress samples: sampled text
    CHAT_DEFAULTS    `tformer chat`: sampled text, longer replies
    OPENAI_DEFAULTS  the server (serve/schemas.py, serve/scheduler.py): OpenAI's documented ones
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ConfigError


@dataclass(frozen=True)
class Defaults:
    """One caller's decoding defaults (generate()'s names). top_k / min_p None: that filter is off."""
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    min_p: float | None
    repetition_penalty: float
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int


DEFAULTS = Defaults(max_new_tokens=20, do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=None,
                    repetition_penalty=1.0, num_beams=1, length_penalty=1.0, early_stopping=False,
                    num_return_sequences=1)
# Sampled text: a common balance between variety and coherence (a little sharper than the model's
# distribution, without its least likely tail), and long enough to read.
TEXT_DEFAULTS = replace(DEFAULTS, max_new_tokens=200, do_sample=True, temperature=0.8, top_p=0.95)
# A chat reply: sampled as text is; it ends at EOS, so the cap only stops a model that never ends a turn
# (`tformer chat` also keeps it within half the context, so the conversation keeps room).
CHAT_DEFAULTS = replace(TEXT_DEFAULTS, max_new_tokens=512)
# OpenAI's API: max_tokens 16 (completions), temperature 1 and top_p 1 (the model's own distribution);
# it has no top-k, so tformer's top_k is off unless a request sets it.
OPENAI_DEFAULTS = replace(DEFAULTS, max_new_tokens=16, do_sample=True, top_k=None)
_D = DEFAULTS   # short, for the defaults below


@dataclass
class Settings:
    """The arguments of generate(), checked. Defaults are HF's (DEFAULTS)."""
    max_new_tokens: int = _D.max_new_tokens
    do_sample: bool = _D.do_sample
    temperature: float = _D.temperature
    top_k: int | None = _D.top_k
    top_p: float = _D.top_p
    min_p: float | None = _D.min_p
    repetition_penalty: float = _D.repetition_penalty
    num_beams: int = _D.num_beams
    length_penalty: float = _D.length_penalty
    early_stopping: bool | str = _D.early_stopping
    num_return_sequences: int = _D.num_return_sequences
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    stop_sequences: list[list[int]] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    tokenizer: object = None
    use_cache: bool = True

    def check(self) -> None:
        def bad(name: str, why: str):
            raise ConfigError(f"{name}={getattr(self, name)!r} {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if self.temperature is None or not self.temperature >= 0:  # `not >=` also refuses NaN
            bad("temperature", "must be >= 0 (0 means greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            bad("top_k", "must be an integer >= 0 (0 or None turns top-k off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1] (1 turns top-p off)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0 (1 turns it off)")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            bad("num_beams", "must be an integer >= 1")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", "must be True, False or 'never'")
        if not isinstance(self.num_return_sequences, int) or self.num_return_sequences < 1:
            bad("num_return_sequences", "must be an integer >= 1")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            bad("num_return_sequences", f"cannot exceed num_beams={self.num_beams}")
        if any(len(s) == 0 for s in self.stop_sequences):
            bad("stop_sequences", "must not contain an empty sequence")
        if self.stop_strings and self.tokenizer is None:
            bad("stop_strings", "need tokenizer=... to decode the generated tokens")

    @property
    def greedy(self) -> bool:
        """Sampling at temperature 0 is greedy decoding (the limit of softmax(z / t) as t -> 0)."""
        return not self.do_sample or self.temperature == 0


def eos_ids(model, eos_token_id=None, tokenizer=None) -> list[int]:
    """The ids that end a text, for every caller: `eos_token_id` when given (an int or a list; []
    for none), else the model config's, else the tokenizer's EOS (when a tokenizer is given)."""
    eos = eos_token_id if eos_token_id is not None else model.cfg.eos_token_id
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(i) for i in eos]


def make_settings(model, *, max_new_tokens=_D.max_new_tokens, do_sample=_D.do_sample, temperature=_D.temperature,
                  top_k=_D.top_k, top_p=_D.top_p, min_p=_D.min_p, repetition_penalty=_D.repetition_penalty,
                  num_beams=_D.num_beams, length_penalty=_D.length_penalty, early_stopping=_D.early_stopping,
                  num_return_sequences=_D.num_return_sequences, eos_token_id=None, pad_token_id=None,
                  stop_sequences=None, stop_strings=None, tokenizer=None, use_cache=True) -> Settings:
    """eos_token_id / pad_token_id default to the model config's (pass eos_token_id=[] for none);
    finished rows are padded with pad_token_id, else the first EOS id, else 0."""
    cfg = model.cfg
    # None means "the default", as in HF (top_k=None: no top-k filter)
    temperature = _D.temperature if temperature is None else temperature
    top_p = _D.top_p if top_p is None else top_p
    repetition_penalty = _D.repetition_penalty if repetition_penalty is None else repetition_penalty
    length_penalty = _D.length_penalty if length_penalty is None else length_penalty
    eos = eos_ids(model, eos_token_id)
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    s = Settings(max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, num_beams,
                 length_penalty, early_stopping, num_return_sequences, eos, pad,
                 [list(map(int, q)) for q in (stop_sequences or [])],
                 [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or []), tokenizer, use_cache)
    s.check()
    return s

"""One home for sampling: the token choice and its guard against NaN / inf logits, shared by
generate(), beam search and the server; one seeding function; the decoding defaults stated once
(generation.settings) and read by the library, the CLI, the LM task's samples and the server."""

import dataclasses
import inspect

import pytest
import torch

from tformer import Decoder, ModelConfig
from tformer.cli import build_parser
from tformer.generation import DEFAULTS, OPENAI_DEFAULTS, TEXT_DEFAULTS, choose, make_generator
from tformer.generation.settings import Settings, make_settings
from tformer.tasks.lm import sample_text

NAN, INF = float("nan"), float("inf")


# --- the guard ----------------------------------------------------------------------------------

def poisoned():
    """(5, 6) logits: row 0 finite; row 1 NaN at its largest; row 2 +inf at token 4; row 3 all NaN;
    row 4 all -inf but for a NaN at token 2."""
    x = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.5, -1.0]]).repeat(5, 1)
    x[1, 2] = NAN
    x[2, 4] = INF
    x[3] = NAN
    x[4] = -INF
    x[4, 2] = NAN
    return x


@pytest.mark.parametrize("do_sample", [False, True])
def test_choose_never_takes_a_nan_and_takes_inf_as_the_limit(do_sample):
    for seed in range(20):
        tokens = choose(poisoned(), do_sample, make_generator(seed)).tolist()
        assert tokens[1] != 2                       # NaN is never chosen nor drawn
        assert tokens[2] == 4                       # +inf: the largest float, certain
        assert tokens[3] == 0 and tokens[4] == 2    # nothing finite: argmax of the raw logits (NaN largest)
        if not do_sample:
            assert tokens == [2, 3, 4, 0, 2]


def test_choose_leaves_finite_logits_to_the_plain_draw():
    """Finite rows: exactly sample() with the same generator (the seeds give the tokens they gave)."""
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    drawn = torch.multinomial(x.softmax(-1), 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    assert torch.equal(choose(x, True, make_generator(7)), drawn)
    assert torch.equal(choose(x, False), x.argmax(-1))


def test_a_row_with_nothing_finite_draws_nothing():
    """As the server did: the generator moves on only for rows that are drawn from."""
    x = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    g = make_generator(3)
    assert choose(torch.full_like(x, NAN), True, g).tolist() == [0]
    assert torch.equal(choose(x, True, g), choose(x, True, make_generator(3)))


def test_make_generator_is_the_seeded_generator_and_leaves_the_global_rng():
    state = torch.random.get_rng_state()
    a, b = make_generator(11), torch.Generator().manual_seed(11)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert not torch.equal(torch.rand(5, generator=make_generator(None)), torch.rand(5, generator=make_generator(None)))
    assert torch.equal(torch.random.get_rng_state(), state)


def poisoned_model():
    """A tiny decoder whose output layer, call k (one per generation step), writes NaN at token 3
    (k % 4 == 0), +inf at token 5 (1), NaN everywhere (2), or nothing (3)."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(kind="decoder", vocab_size=29, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                max_seq_len=64)).eval().double()
    calls = [0]

    def poison(module, args, out):
        k, calls[0] = calls[0], calls[0] + 1
        if k % 4 == 0:
            out[..., 3] = NAN
        elif k % 4 == 1:
            out[..., 5] = INF
        elif k % 4 == 2:
            out[:] = NAN
        return out

    model.lm_head.register_forward_hook(poison)
    return model, calls


def served_tokens(model, prompt, n, **sampling):
    """The server's choice (serve.scheduler.Sequence.choose) over the same logits, step by step."""
    pytest.importorskip("fastapi")
    from tformer.serve.scheduler import Sampling, Sequence

    seq = Sequence(0, prompt, Sampling(max_tokens=n, **sampling), tokenizer=None, eos=set(), sink=lambda e: None)
    cache, ids, out = model.new_cache(1, len(prompt) + n), torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(n):
            out.append(seq.choose(model.step(ids, cache)[0]))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("library, server", [
    (dict(do_sample=True, seed=4), dict(seed=4)),
    (dict(do_sample=True, seed=9, temperature=0.7, top_k=8, top_p=0.9), dict(seed=9, temperature=0.7, top_k=8,
                                                                             top_p=0.9)),
    (dict(repetition_penalty=1.3), dict(temperature=0, repetition_penalty=1.3)),   # greedy, not the fast path
])
def test_generate_guards_nan_and_inf_logits_as_the_server_does(library, server):
    model, calls = poisoned_model()
    prompt, n = [1, 2, 3, 4], 16
    new = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=[], **library)[0, 4:].tolist()
    assert new[1::4] == [5] * 4 and new[2::4] == [0] * 4 and 3 not in new[0::4]
    calls[0] = 0
    assert served_tokens(model, prompt, n, **server) == new


@pytest.mark.parametrize("options", [dict(), dict(do_sample=True, seed=2), dict(repetition_penalty=1.2)])
def test_beam_search_gets_the_same_guard(options):
    model, _ = poisoned_model()
    out = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=12, num_beams=3, eos_token_id=[], **options)
    new = out[0, 4:].tolist()
    assert len(new) == 12 and new[1::4] == [5] * 3 and new[2::4] == [0] * 3 and 3 not in new[0::4]


def test_extreme_settings_are_sampled_as_the_server_samples_them():
    """A temperature or penalty of 1e-300 overflows the logits to inf (generate() used to fail here)."""
    model, _ = poisoned_model()
    model.lm_head._forward_hooks.clear()
    for library, server in [(dict(temperature=1e-300), dict(temperature=1e-300)),
                            (dict(repetition_penalty=1e-300), dict(repetition_penalty=1e-300))]:
        new = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=10, do_sample=True, seed=5, eos_token_id=[],
                             **library)[0, 4:].tolist()
        assert served_tokens(model, [1, 2, 3, 4], 10, seed=5, **server) == new


# --- the defaults, stated once --------------------------------------------------------------------

def test_generate_takes_hugging_faces_defaults_from_settings():
    values = dataclasses.asdict(DEFAULTS)
    assert values == dict(max_new_tokens=20, do_sample=False, temperature=1.0, top_k=50, top_p=1.0, min_p=None,
                          repetition_penalty=1.0, num_beams=1, length_penalty=1.0, early_stopping=False,
                          num_return_sequences=1)   # HF's GenerationConfig
    params = inspect.signature(make_settings).parameters
    assert {k: params[k].default for k in values} == values
    assert {k: getattr(Settings(), k) for k in values} == values


def test_the_cli_and_the_lm_samples_share_the_text_defaults():
    from tformer.cli import generate as generate_cli
    from tformer.cli.common import sampling_options

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p"])
    assert args.temperature is None                          # not given: run() fills it, as the others
    options = {**sampling_options(args, generate_cli.DEFAULTS), "num_beams": args.num_beams}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "num_beams"):
        assert options[name] == getattr(TEXT_DEFAULTS, name), name
    assert args.max_new_tokens is None                       # filled in by run() from TEXT_DEFAULTS
    params = inspect.signature(sample_text).parameters
    for name in ("max_new_tokens", "temperature", "top_k", "top_p"):
        assert params[name].default == getattr(TEXT_DEFAULTS, name), name
    assert (TEXT_DEFAULTS.temperature, TEXT_DEFAULTS.top_p) != (DEFAULTS.temperature, DEFAULTS.top_p)


def test_the_server_takes_openais_defaults_from_settings():
    pytest.importorskip("fastapi")
    from tformer.serve.scheduler import Sampling
    from tformer.serve.schemas import ChatRequest, CompletionRequest

    assert (OPENAI_DEFAULTS.max_new_tokens, OPENAI_DEFAULTS.temperature, OPENAI_DEFAULTS.top_p) == (16, 1.0, 1.0)
    body = CompletionRequest(model="m", prompt="p")
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    sampling = Sampling(max_tokens=1)
    assert body.max_tokens == OPENAI_DEFAULTS.max_new_tokens and body.n == OPENAI_DEFAULTS.num_return_sequences
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        expected = getattr(OPENAI_DEFAULTS, name)
        assert getattr(body, name) == getattr(chat, name) == getattr(sampling, name) == expected, name
    assert CompletionRequest.model_json_schema()["properties"]["temperature"]["default"] == OPENAI_DEFAULTS.temperature

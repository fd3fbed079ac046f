"""tformer serve --prompt-lookup N / --draft-model RUN: speculative decoding inside the batch
(serve/scheduler.py, serve/speculation.py), each row drafting from its own text or by a small model, and
checking the drafts in the step's ragged pass. References: generate() on
each prompt alone (greedy, a separately loaded model), the same requests on a server without drafts
(seeded samples with penalties, logit bias and logprobs; JSON-schema answers; adapters), the metrics'
counts against their invariant, and the CLI's refusals."""

import re
import string
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tformer
from serve_util import char_tokenizer, client, httpx, save_tiny, serving
from tformer.cli import main
from tformer.data.tokenizers import Tokenizer
from tformer.model.lora import apply_lora, lora_layers, merge

# repeated text, so the rows find their n-grams (a random model's greedy text soon repeats itself too)
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat. the cat sat on the", "hello",
           "once upon a time, once upon a time, once", "to be or not to be, " * 11]
LENGTHS = [40, 33, 25, 47, 30]        # the last prompt (220 characters) + 30 reaches near the 256 context


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("speculative") / "dec", "decoder", positional="rope", n_kv_heads=2,
                     max_seq_len=256)


def metric(base: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def reference(model, prompt: str, max_tokens: int) -> str:
    tok = char_tokenizer()
    src = torch.tensor([tok.encode(prompt)])
    return tok.decode(model.generate(src, max_new_tokens=max_tokens, eos_token_id=[])[0, src.size(1):])


def greedy_round(base: str) -> tuple[list, float, float, float]:
    """Every prompt at once (more requests than rows: slots move and are freed; chunked prompts), greedy ->
    (the answers, tokens drafted, drafts accepted, tokens generated)."""
    c = client(base)
    got = concurrently(lambda i: c.completions.create(model="dec", prompt=PROMPTS[i], max_tokens=LENGTHS[i],
                                                      temperature=0), range(len(PROMPTS)))
    names = ("speculative_draft_tokens", "speculative_accepted_tokens", "generated_tokens")
    return got, *(metric(base, f"tformer_{name}_total") for name in names)


def test_greedy_rows_with_drafts_equal_generate_alone_and_drafts_are_taken(decoder):
    with serving(decoder, max_batch=3, prefill_tokens=8, prompt_lookup=2, draft_tokens=4) as (base, _):
        got, drafted, accepted, generated = greedy_round(base)
    model = tformer.load(decoder)
    assert [r.choices[0].text for r in got] == [reference(model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert [r.usage.completion_tokens for r in got] == LENGTHS
    assert generated == sum(LENGTHS)
    assert 0 < accepted <= drafted        # some drafts were right: those tokens took no pass of their own


@pytest.fixture(scope="module")
def drafts(decoder, tmp_path_factory):
    """Draft models: the model itself (every greedy draft right, up to rounding) and a smaller random one
    with the same tokenizer (mostly wrong: the rows reject)."""
    return {"itself": decoder, "other": save_tiny(tmp_path_factory.mktemp("draft") / "small", "decoder", seed=7,
                                                  d_model=16, n_layers=1, max_seq_len=256)}


@pytest.mark.parametrize("which", ["itself", "other"])
def test_greedy_rows_with_a_draft_model_equal_generate_alone(decoder, drafts, which):
    with serving(decoder, draft=drafts[which], max_batch=3, prefill_tokens=8, draft_tokens=3) as (base, _):
        got, drafted, accepted, generated = greedy_round(base)
    model = tformer.load(decoder)
    assert [r.choices[0].text for r in got] == [reference(model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert generated == sum(LENGTHS)
    # each row drafts in every step but its last, up to 3 tokens: at least a third of its tokens were drafted
    assert drafted >= (sum(LENGTHS) - len(LENGTHS)) / 3
    if which == "itself":
        assert accepted >= 0.95 * drafted     # the model's own greedy tokens (a near tie may round the other way)
    else:
        assert accepted <= 0.5 * drafted


def test_sampled_penalised_rows_get_the_text_they_get_without_drafts(decoder):
    """Seeded samples with every processor and logprobs: the same text and log-probabilities with and
    without drafts (each position's choice is the row's own, from its own generator, in the same order)."""
    asks = [dict(prompt=p, max_tokens=30, temperature=t, seed=k, top_p=0.9, frequency_penalty=0.4,
                 presence_penalty=0.2, logit_bias={"3": 2.0, "5": -100}, logprobs=2)
            for k, (p, t) in enumerate(zip(PROMPTS, [0.3, 0.5, 1.0, 0.3, 0.7]))]
    answers, accepted = [], []
    for options in ({}, dict(prompt_lookup=1), dict(draft=decoder)):
        with serving(decoder, max_batch=4, prefill_tokens=16, **options) as (base, _):
            c = client(base)
            answers.append(concurrently(lambda ask: c.completions.create(model="dec", **ask).choices[0], asks))
            accepted.append(metric(base, "tformer_speculative_accepted_tokens_total"))
    for plain, *drafted in zip(*answers):
        for other in drafted:                                   # by prompt lookup, by a draft model
            assert other.text == plain.text
            assert other.logprobs.tokens == plain.logprobs.tokens
            assert other.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert accepted[1] > 0 and accepted[2] > 0


def test_json_schema_answers_are_the_same_with_drafts(tmp_path):
    pytest.importorskip("xgrammar")
    path = save_tiny(tmp_path / "json", "decoder", positional="rope", max_seq_len=384,
                     tokenizer=Tokenizer.char(string.printable))
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green"]},
                                                        "minItems": 1, "maxItems": 6}}, "required": ["tags"],
              "additionalProperties": False}
    body = dict(model="json", max_tokens=120, response_format={"type": "json_schema", "json_schema": {
        "name": "tags", "schema": schema, "strict": True}})
    asks = [{**body, "prompt": f"tags {k}: ", "temperature": t, "seed": k} for k, t in enumerate([0, 0, 0.8, 1.0])]
    answers = []
    for options in ({}, dict(prompt_lookup=3, draft_tokens=6)):
        with serving(path, max_batch=4, **options) as (base, _):
            answers.append(concurrently(lambda ask: httpx.post(f"{base}/v1/completions", json=ask, timeout=60)
                                        .json()["choices"][0]["text"], asks))
            accepted = metric(base, "tformer_speculative_accepted_tokens_total")
    assert answers[1] == answers[0]
    assert all(text.startswith('{"tags":[') for text in answers[0])
    assert accepted > 0                                                 # `"green","green"` repeats itself


def test_rows_of_different_adapters_check_their_drafts_with_their_own(decoder, tmp_path):
    model = tformer.load(decoder)
    apply_lora(model, 4, 8, targets=("q", "v", "lm_head"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for adapter in layer.lora.values():
                adapter.a.copy_(torch.randn(adapter.a.shape, generator=g) * 0.3)
                adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.3)
    tformer.save(model, tmp_path / "alpha", tokenizer=char_tokenizer(), adapter_base=decoder)
    jobs = [(name, i) for name in ("dec", "alpha") for i in range(len(PROMPTS))]
    with serving(decoder, [f"alpha={tmp_path / 'alpha'}"], max_batch=4, prompt_lookup=2) as (base, _):
        c = client(base)
        got = concurrently(lambda job: c.completions.create(model=job[0], prompt=PROMPTS[job[1]],
                                                            max_tokens=LENGTHS[job[1]], temperature=0), jobs)
        accepted = metric(base, "tformer_speculative_accepted_tokens_total")
    references = {"dec": tformer.load(decoder), "alpha": merge(tformer.load(tmp_path / "alpha"))}
    assert [r.choices[0].text for r in got] == [reference(references[n], PROMPTS[i], LENGTHS[i]) for n, i in jobs]
    assert accepted > 0


def test_cli_refuses_drafts_it_cannot_serve(decoder, tmp_path, capsys):
    assert main(["serve", "--model", str(decoder), "--num-draft-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --num-draft-tokens needs --prompt-lookup N or --draft-model RUN\n"
    assert main(["serve", "--model", str(decoder), "--prompt-lookup", "2", "--draft-model", str(decoder)]) == 2
    assert capsys.readouterr().err == "error: give --draft-model or --prompt-lookup, not both (one source of drafts)\n"
    other = save_tiny(tmp_path / "other", "decoder", tokenizer=Tokenizer.char("xyz"), max_seq_len=256)
    short = save_tiny(tmp_path / "short", "decoder", max_seq_len=64)
    for draft, why in ((other, "has another tokenizer"), (short, "has a context of 64 positions")):
        assert main(["serve", "--model", str(decoder), "--draft-model", str(draft)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --draft-model") and why in err and err.count("\n") == 1
    seq2seq = save_tiny(tmp_path / "s2s", "encoder-decoder")
    assert main(["serve", "--model", str(seq2seq), "--prompt-lookup", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompt-lookup serves decoders") and err.count("\n") == 1


def test_cli_refuses_serving_flags_the_model_would_not_use(tmp_path, capsys):
    """The pool's and the prefix cache's flags on a model that has neither are one-line errors, not ignored."""
    seq2seq, encoder = save_tiny(tmp_path / "s2s", "encoder-decoder"), save_tiny(tmp_path / "enc", "encoder")
    assert main(["serve", "--model", str(seq2seq), "--prefix-cache-mb", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prefix-cache-mb applies to decoders;") and "encoder-decoder" in err
    assert err.count("\n") == 1
    assert main(["serve", "--model", str(encoder), "--prefill-tokens", "64", "--kv-cache-dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prefill-tokens, --kv-cache-dtype apply to models that generate text;")
    assert "is an encoder" in err and err.count("\n") == 1


def test_a_row_that_never_drafted_moves_into_a_freed_slot(drafts):
    """The draft's pool grows when rows first draft: a row admitted after the last drafting step and moved
    (a cancelled row's slot) has no allocated slot to copy, and holds nothing."""
    from tformer.serve.speculation import DraftModel

    draft = DraftModel(tformer.load(drafts["other"]), 3, max_batch=4, max_len=256)
    draft.pool.reserve(0, 1, 8)                           # one slot allocated, then rows 1-3 joined
    draft.pool.lengths[0] = 5
    draft.move(3, 0)
    assert draft.pool.lengths[:4] == [0, 0, 0, 0] and draft.pool.rows == 1

"""The benchmark harness (not speed: speed is never a unit test): timing bookkeeping, the
byte and FLOP counts behind the ceilings, the table, and the command's error handling."""

import json

import pytest
import torch

import tformer
from tformer.bench import format_table, write_json
from tformer.bench.common import ReadProbe, interleaved_times, median_time, param_count, share_of_reads_around
from tformer.bench.decode import _decode_case, _peers, bytes_per_token
from tformer.bench.training import flops_per_token
from tformer.cli import main


def test_median_time_runs_warmup_then_repeats():
    calls = []
    assert median_time(lambda: calls.append(1), "cpu", repeats=4, warmup=2) >= 0
    assert len(calls) == 6


def test_interleaved_times_alternates_peers():
    order = []
    times = interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, "cpu",
                              repeats=3, warmup=1)
    assert set(times) == {"a", "b"}
    assert order == ["a", "b"] + ["a", "b"] * 3


def test_bytes_per_token_counts_each_weight_once_without_position_table():
    cfg = tformer.preset("tiny", vocab_size=50, max_seq_len=32)                  # tied output layer
    model = tformer.Decoder(cfg)
    unique = {p.data_ptr(): p for p in model.parameters()}
    expected = sum(p.numel() for p in unique.values()) - 32 * cfg.d_model
    assert param_count(model) == sum(p.numel() for p in unique.values())
    assert bytes_per_token(model) == 4 * expected
    assert bytes_per_token(model.to(torch.bfloat16)) == 2 * expected


def test_bytes_per_token_counts_the_bf16_screen_a_greedy_step_reads():
    from tformer.kernels import gemv
    if not gemv.available():
        pytest.skip("the decoding kernel is not built here")
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=4096, max_seq_len=32)).eval()
    full = bytes_per_token(model)
    model.generate(torch.randint(0, 4096, (1, 4)), max_new_tokens=2)               # greedy: the screen is made
    head = model.lm_head.weight.numel()
    assert model.lm_head.plan.screen is not None
    assert bytes_per_token(model, screened=False) == full
    assert bytes_per_token(model) == full - 4 * head + 2 * (-(-4096 // 16) * 16) * model.cfg.d_model


def test_flops_per_token_matches_hand_count():
    """6 FLOPs per weight per token (2 forward, 4 backward) + QKᵀ and αV: 2·T·D each forward,
    ×3 with backward, per layer."""
    n, layers, d, t = 1000, 2, 16, 8
    assert flops_per_token(n, layers, d, t) == 6 * n + layers * 3 * (2 * t * d + 2 * t * d)


def _result():
    return {"machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "torch": "x"}, "quick": True,
            "ceilings": {"gemm_fp32_GFLOPs": 100.0, "gemm_bf16_GFLOPs": 200.0, "read_GBps": 20.0},
            "seconds": 1.0,
            "rows": [{"bench": "decode", "case": "c1", "unit": "tok/s", "tformer": 30.0, "peer": 15.0,
                      "peer_name": "HF", "ratio": 2.0, "target": 1.0, "ceiling": 40.0, "utilisation": 0.75,
                      "peer_utilisation": 0.375, "utilisation_name": "of BW", "same_tokens": True}]}


def test_format_table_shows_ratio_ceiling_and_checks(tmp_path):
    table = format_table(_result())
    assert "Test CPU" in table and "read 20 GB/s" in table
    row = [line for line in table.splitlines() if line.startswith("| decode")][0]
    assert "**2.00x**" in row and "75% of BW" in row and "same tokens" in row
    path = tmp_path / "r.json"
    write_json(_result(), str(path))
    assert json.loads(path.read_text())["rows"][0]["ratio"] == 2.0


def test_cli_names_match_the_benchmarks():
    from tformer import bench
    from tformer.cli import bench as cli_bench
    assert cli_bench.NAMES == bench.BENCHES


@pytest.mark.parametrize("argv", [["bench", "--json", "/no/such/folder/r.json"], ["bench", "--threads", "0"],
                                  ["bench", "--only", "nonsense"]])
def test_cli_rejects_bad_arguments_with_one_line(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:                                                      # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_perplexity_of_uniform_model_is_vocab_size():
    """Zero logits = the uniform distribution: perplexity is exactly the vocabulary size."""
    from tformer.bench.quality import perplexity
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=37, max_seq_len=16, tie_embeddings=False)).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    ids = torch.randint(0, 37, (100,), generator=torch.Generator().manual_seed(0))
    assert perplexity(model, ids, 16, torch.float32, "cpu") == pytest.approx(37, rel=1e-5)


def test_perplexity_by_steps_equals_the_whole_windows():
    """Feeding each window a token at a time through the KV cache scores what the whole window does."""
    from tformer.bench.quality import perplexity, perplexity_by_steps
    torch.manual_seed(0)
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=37, max_seq_len=16)).eval()
    ids = torch.randint(0, 37, (100,), generator=torch.Generator().manual_seed(0))
    whole = perplexity(model, ids, 16, torch.float32, "cpu")
    assert perplexity_by_steps(model, ids, 16, "cpu", batch=4) == pytest.approx(whole, rel=1e-4)
    assert whole > 20                                                           # an untrained model: near uniform


def test_sub_batches_cover_batch_in_order_within_padding_slack():
    from tformer.bench.encoder import sub_batches
    lengths = [256, 250, 120, 60, 58, 57, 20, 19, 5]                             # sorted longest first
    runs = sub_batches(lengths, 1.2)
    assert [i for run in runs for i in run] == list(range(len(lengths)))
    for run in runs:
        assert lengths[run[0]] * len(run) <= 1.2 * sum(lengths[i] for i in run)
    assert sub_batches(lengths, float("inf")) == [list(range(len(lengths)))]


def test_cli_quality_model_must_exist(capsys):
    assert main(["bench", "--quality-model", "/no/such/run"]) == 2
    assert capsys.readouterr().err.startswith("error: /no/such/run does not exist")


def test_decode_roofline_uses_the_bandwidth_sampled_alongside_the_runs():
    ours, hf = _peers(dict(n_layers=1, d_model=32, n_heads=2, vocab=64, n_positions=64), torch.float32, "cpu")
    probe = ReadProbe("cpu", mbytes=8)
    ceilings = {"read_GBps": 1e-9, "gemm_fp32_GFLOPs": 1e9}      # start-of-run bandwidth: must not be used
    row = _decode_case(ours, hf, 1, 4, 3, "cpu", 1, "tiny", ceilings, 1.0, probe)
    assert row["read_GBps"] > 0.01
    read_bound = 1 / (bytes_per_token(ours) / (row["read_GBps"] * 1e9))      # the GEMM peak here is huge
    assert row["ceiling"] == pytest.approx(read_bound)
    assert row["utilisation"] == pytest.approx(row["tformer"] / row["ceiling"])
    assert probe.gbps(1.0) == pytest.approx(3 * 8 * 2**20 / 1e9)             # three sums of 8 MiB in 1 s


def test_a_run_is_measured_against_the_reads_sampled_around_it():
    # 1 GB read in 0.1 s = 10 GB/s. Run 0 meets memory at 20 GB/s on both sides (share 0.5), run 1
    # at 10 and 30 (0.5), run 2 at 5 and 15 (1.0): median 0.5 (the median of all six samples, 17.5
    # GB/s, would say 0.57).
    assert share_of_reads_around([0.1, 0.1, 0.1], 1e9, [20, 10, 5], [20, 30, 15]) == pytest.approx(0.5)
    assert share_of_reads_around([0.2], 1e9, [10], [10]) == pytest.approx(0.5)      # 5 GB/s of 10
    with pytest.raises(ValueError):
        share_of_reads_around([0.1, 0.1], 1e9, [10], [10])                           # a run without its samples

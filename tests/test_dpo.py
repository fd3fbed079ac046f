"""DPO (tformer.training.dpo) against trl's own code path: DPOTrainer._compute_loss, run on tiny random
Hugging Face Llamas (policy and reference) patched with trl's fused LM head, and the same weights
imported into tformer."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import tformer
from tformer.training.dpo import REWARD_METRICS, dpo_loss, sequence_logprobs

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from hf_util import save_hf  # noqa: E402

VOCAB, PAIRS, LENGTH, BETA = 61, 4, 14, 0.1


def tiny_llama(path, seed):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=48, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return save_hf(transformers.LlamaForCausalLM(cfg), path, seed=seed)


def preference_batch(seed: int = 0):
    """trl's layout: rows [chosen; rejected] (2N, T) sharing each pair's prompt, right-padded;
    completion_mask 1 on the response tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2 * PAIRS, LENGTH), generator=gen)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i in range(PAIRS):
        prompt = int(torch.randint(2, 6, (), generator=gen))
        ids[PAIRS + i, :prompt] = ids[i, :prompt]                  # the same prompt, another response
        for row in (i, PAIRS + i):
            length = int(torch.randint(prompt + 2, LENGTH + 1, (), generator=gen))
            attention[row, :length] = 1
            completion[row, prompt:length] = 1
    return ids.masked_fill(attention == 0, 0), attention, completion


def trl_dpo(policy, ref, inputs):
    """trl's DPOTrainer._compute_loss (loss_type "sigmoid", standard DPO), unbound, on a stand-in
    trainer holding just what that method reads; returns (loss, the metrics it logged)."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                                  unwrap_model=lambda m: m)
    trainer = SimpleNamespace(model=policy, ref_model=ref, accelerator=accelerator, beta=BETA,
                              loss_types=["sigmoid"], loss_weights=[1.0], f_divergence_type="reverse_kl",
                              ld_alpha=None, precompute_ref_logps=False, aux_loss_enabled=False, use_weighting=False,
                              args=SimpleNamespace(gradient_checkpointing_kwargs=None), _tp_size=1,
                              _total_train_tokens=0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    loss = DPOTrainer._compute_loss(trainer, policy, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["eval" if not policy.training else "train"].items()}


def test_dpo_loss_and_rewards_equal_trl(tmp_path):
    policy_hf, ref_hf = tiny_llama(tmp_path / "policy", 0), tiny_llama(tmp_path / "ref", 1)
    policy, ref = tformer.from_hf(tmp_path / "policy"), tformer.from_hf(tmp_path / "ref")
    ids, attention, completion = preference_batch()
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    with torch.no_grad():
        expected_loss, logged = trl_dpo(policy_hf, ref_hf, inputs)
        ours = sequence_logprobs(policy, ids, attention, completion).chunk(2)
        ours_ref = sequence_logprobs(ref, ids, attention, completion).chunk(2)
    loss, metrics = dpo_loss(*ours, *ours_ref, beta=BETA)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-5)
    for name in REWARD_METRICS + ("logps/chosen", "logps/rejected"):
        got = metrics[name] if name in metrics else ours[name.endswith("rejected")].mean().item()
        assert abs(got - logged[name]) <= 1e-5, (name, got, logged[name])
    assert 0 < logged["rewards/accuracies"] < 1                  # both orders occur: the comparison is checked


def test_sequence_logprobs_equal_trl_fused_head_and_by_hand(tmp_path):
    from trl.trainer.utils import add_fused_lm_head

    hf = tiny_llama(tmp_path / "m", 2)
    model = tformer.from_hf(tmp_path / "m")
    ids, attention, completion = preference_batch(seed=3)
    labels = ids.masked_fill(completion == 0, -100)
    add_fused_lm_head(hf)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs.sum(1)
        got = sequence_logprobs(model, ids, attention, completion)
        logits = hf(input_ids=ids, attention_mask=attention).logits.log_softmax(-1)   # the formula, by hand
    by_hand = torch.stack([sum(logits[i, t - 1, ids[i, t]] for t in range(1, LENGTH) if completion[i, t])
                           for i in range(len(ids))])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-5)


def test_dpo_loss_is_log2_at_the_reference_and_falls_with_the_margin():
    logps = torch.randn(5)
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.5)    # policy = reference
    assert abs(loss.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6 and metrics["rewards/margins"] == 0
    better, m = dpo_loss(logps + 1, logps - 1, logps, logps, beta=0.5)
    assert better < loss and m["rewards/accuracies"] == 1 and abs(m["rewards/margins"] - 1.0) < 1e-6
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(logps, logps, logps, logps, beta=0)

"""Direct preference optimisation (DPO; Rafailov et al. 2023), as trl's DPOTrainer computes it with
its default `loss_type="sigmoid"`:

    loss = -log sigmoid(beta * [(log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))])

averaged over the pairs, where log pi(y) is the sum of the log-probabilities of the response tokens
(the prompt's tokens and the padding do not count) under the policy pi or the frozen reference
pi_ref. The implicit reward of a response is beta * (log pi(y) - log pi_ref(y)); its batch means are
logged under trl's names (REWARD_METRICS).

Shapes: N pairs (or sequences), T tokens, V the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def sequence_logprobs(model: nn.Module, ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """(N,): for each row of `ids` (N, T), the sum of log p(ids[t] | ids[:t]) over the positions t where
    `response_mask` is 1, under a decoder `model` (in fp32). `attention_mask` (N, T) is 1 on real
    tokens; rows are padded on the right. The first token has no prediction, so it never counts."""
    logits = model(ids, attention_mask).float()                                    # (N, T, V)
    targets = ids[:, 1:]                                                           # token t+1 read at t
    token_logp = -F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
    keep = (response_mask[:, 1:] * attention_mask[:, 1:]).to(token_logp.dtype)     # (N, T-1)
    return (token_logp.view_as(keep) * keep).sum(dim=1)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float) -> tuple[Tensor, dict[str, float]]:
    """The sigmoid DPO loss (a scalar, mean over the N pairs) from the sequence log-probabilities (N,)
    of the chosen and rejected responses under the policy and the reference, and the logged
    metrics: the mean implicit rewards of each side, their mean margin and how often the chosen
    response's reward is the higher one (trl's rewards/chosen, /rejected, /margins, /accuracies)."""
    if not beta > 0:
        raise ValueError(f"beta={beta!r} must be > 0 (the DPO temperature; 0.1 is usual)")
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen_logratio - rejected_logratio)).mean()
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratio.detach()
        rejected_rewards = beta * rejected_logratio.detach()
        metrics = {"rewards/chosen": chosen_rewards.mean().item(),
                   "rewards/rejected": rejected_rewards.mean().item(),
                   "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
                   "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item()}
    return loss, metrics

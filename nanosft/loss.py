"""The causal-LM loss, the model's side of walkthrough 2.5 `compute_loss`: `outputs["loss"]`.

`causal_lm_loss` over full logits, as transformers' ForCausalLMLoss. The fused LM head that TRL's
SFTTrainer asks the model for (`model(**inputs, fused_lm_head=True)`), which never holds the
(B, T, V) logits, is a speed path: nanosft.fast.lm_head.
"""

import torch
import torch.nn.functional as F


def causal_lm_loss(logits, labels, num_items_in_batch=None):
    """Next-token cross entropy over fp32 logits, -100 ignored; sum / num_items_in_batch when
    given, else mean. Mirrors: transformers ForCausalLMLoss,
    fixed_cross_entropy"""
    logits = logits.float()
    # Shift the labels, not the logits: position t predicts labels[t+1], the last one gets -100.
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.flatten(0, -2), shift_labels.flatten(), ignore_index=-100,
                           reduction=reduction)
    if num_items_in_batch is None:
        return loss
    return loss / torch.as_tensor(num_items_in_batch, device=loss.device)

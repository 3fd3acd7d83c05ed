"""transformers as the outside judge of an exported model: its logits and its held-out
loss on the samples `megatron-gnmr evaluate` reads, computed by transformers' own LLaMA
(`scripts/hf_perplexity.py` prints the two perplexities side by side; the tests bound them).

transformers is a test and tooling dependency, not a runtime one: imported here only.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load(hf_dir: Path):
    """transformers' model for `hf_dir`, float32, in evaluation mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@torch.no_grad()
def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] float32 for `tokens` [batch, seq] (no attention mask: every row
    is full length, as a training sample is)."""
    return model(input_ids=tokens).logits.float()


@torch.no_grad()
def mean_loss(model, samples) -> float:
    """The mean next-token loss over the samples' masked positions (GPTDataset samples:
    tokens, labels, loss_mask), as `evaluate`'s ppl task averages it."""
    total, count = 0.0, 0.0
    for sample in samples:
        tokens = torch.as_tensor(sample["tokens"]).long().unsqueeze(0)
        labels = torch.as_tensor(sample["labels"]).long()
        mask = torch.as_tensor(sample["loss_mask"]).double()
        losses = torch.nn.functional.cross_entropy(logits(model, tokens)[0].double(), labels,
                                                   reduction="none")
        total += float((losses * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)

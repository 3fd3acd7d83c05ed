"""Tied input and output embeddings across the Hugging Face border, for every family's mapping.

transformers' `tie_word_embeddings` is megatron-core's `share_embeddings_and_output_weights`
(our `--no-untie-embeddings-and-output-weights`): one matrix, the embedding, is also the output
layer; it is kept one matrix both ways (untying it doubles the vocabulary's share of the
model: +0.5 GB in bf16 for a Llama 3.2 1B, and fine-tuning would then move two matrices).
transformers saves a tied model without `lm_head.weight`; it loads one that has it tied only
when the two are equal (other values: it keeps them apart, and warns), so a tied config with a
different head on disk is refused, not silently tied; an untied config without a head is
refused too (transformers would give it a random one).
"""

from __future__ import annotations

import torch

from megatron_gnmr.errors import UserError

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
OUTPUT_LAYER = "output_layer.weight"


def tied(hf: dict) -> bool:
    """config.json's tie_word_embeddings (absent: False, the default of every class read)."""
    return hf.get("tie_word_embeddings", False) is True


def output_layer_to_hf(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """`lm_head.weight` of an untied run; nothing for a tied one (its embedding is the head)."""
    return {HEAD: state[OUTPUT_LAYER]} if config.model.untie_embeddings_and_output_weights \
        else {}


def output_layer_from_hf(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """megatron's `output_layer.weight` of an untied model; a tied one has none (megatron-core
    reads the embedding's)."""
    return {OUTPUT_LAYER: weights[HEAD]} if config.model.untie_embeddings_and_output_weights \
        else {}


def tied_head_on_disk(weights: dict, hf: dict) -> list[str]:
    """A tied model's `lm_head.weight` saved beside its embedding (the same values: checked by
    `check_tied_weights`), which the import leaves out."""
    return [HEAD] if tied(hf) and HEAD in weights else []


def check_tied_weights(weights: dict[str, torch.Tensor], hf: dict, where: str) -> None:
    """config.json's tie_word_embeddings agrees with the head on disk (a UserError says how
    not)."""
    if EMBEDDING not in weights:
        return  # the weights' own check names the missing embedding
    if tied(hf) and HEAD in weights and not torch.equal(weights[HEAD], weights[EMBEDDING]):
        raise UserError(f"{where}: config.json's tie_word_embeddings true, but the weights hold "
                        f"an {HEAD} that is not {EMBEDDING} (transformers would keep them "
                        "apart); set tie_word_embeddings false, or drop the head")
    if not tied(hf) and HEAD not in weights:
        raise UserError(f"{where}: config.json's tie_word_embeddings "
                        f"{hf.get('tie_word_embeddings', 'absent (false)')}, but the weights "
                        f"hold no {HEAD} (transformers would give the model a random one); set "
                        "tie_word_embeddings true if the embedding is the output layer")

"""megatron's core attention interface computed by torch's fused attention
(`torch.nn.functional.scaled_dot_product_attention`): the core attention of the local layers
wherever it is not an emulated low-precision unit.

megatron-core's local `DotProductAttention` materializes every [batch x heads, seq, seq]
score matrix (a `baddbmm`, a masked softmax, a `bmm`, each a pass over seq^2 values, and the
probabilities kept for the backward). Torch's SDPA picks a fused kernel instead: flash,
memory-efficient or cuDNN attention on a GPU, its flash kernel on the CPU. The arithmetic is
megatron's, step by step:

- softmax scale: megatron's `softmax_scale` (1/sqrt(d_head) unless given), times the layer
  number when `apply_query_key_layer_scaling` divided it (megatron multiplies it back inside
  its softmax);
- masks: megatron's rule in `FusedScaleMaskSoftmax`: no mask given and a causal layer (more
  than one query) is causal attention (`is_causal`, torch's lower-triangular mask); a given
  boolean mask (True: masked out) is used as it is, whatever the layer's mask type. Megatron
  fills masked scores with -10000, torch with -inf: the same probabilities wherever a row
  keeps one key (a row masked entirely is megatron's uniform average, torch's zeros);
- GQA: each query head reads its group's key/value head, repeated as megatron repeats them;
- dropout: megatron's `attention_dropout` on the probabilities in training, drawn inside the
  model-parallel RNG tracker's fork as megatron draws it (outside it under sequence
  parallelism), so the default generator is untouched and a selective recompute replays the
  same mask.

What SDPA cannot express falls back to megatron's own forward: sliding windows, softmax
offsets (`softmax_type` other than vanilla), attention bias, packed sequences (which
megatron's local attention refuses), and a causal mask over unequal query and key lengths.
Where the key and value widths differ (multi-latent attention), torch takes them as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    """megatron's `DotProductAttention` with its forward through torch's SDPA."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs):
        """`k_channels`, `v_channels`: the query/key and value widths per head where they
        differ (multi-latent attention), as Transformer Engine's attention takes them; the
        widths are read off the tensors."""
        super().__init__(*args, **kwargs)
        self.sdpa_scale = self.softmax_scale * (
            self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if not self._expressible(query, key, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1 and key.shape[2] != query.shape[2]:  # GQA, as megatron expands it
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [seq, batch, heads, width] -> [batch, heads, seq, width]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask, causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True masks out; torch: True attends
        elif self.attn_mask_type == AttnMaskType.causal and query.shape[0] > 1:
            causal = True
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, mask, causal, dropout)
        else:
            out = self._sdpa(q, k, v, mask, causal, dropout)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # heads x value width

    def _sdpa(self, q, k, v, mask, causal: bool, dropout: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=causal, scale=self.sdpa_scale)

    def _expressible(self, query, key, attention_bias, packed_seq_params) -> bool:
        """Whether SDPA computes what megatron's forward would (else megatron's runs)."""
        if attention_bias is not None or packed_seq_params is not None:
            return False
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            return False
        causal_unequal = self.attn_mask_type == AttnMaskType.causal and \
            query.shape[0] != key.shape[0]
        return not causal_unequal

"""GPT-2 and Llama, written tensor-parallel from the start.

Shapes: b batch, s sequence (s / t inside blocks with sequence parallelism), h d_model,
n query heads, k kv heads, d head dim, f d_ff, V padded vocab, t tp size. With context
parallelism (cp > 1) s is this rank's zigzag shard of the sequence, seq_len / cp tokens at
their global positions (megatronish.context), and attention is ring attention over the cp group.
Attention: qkv column-parallel [h -> (n + 2k) d], heads split over tp; output row-parallel.
MLP: column-parallel up (and gate for llama), row-parallel down. Logits come out split over
the vocab, [b, s, V / t], and go straight into the vocab-parallel loss.

The fused qkv weight is laid out by kv group: for each of the k groups, its n/k query heads,
then its key head, then its value head. Contiguous blocks of it are whole groups, so every tp
rank gets the heads it needs and the full weight is the same at every tp.
"""

from megatronish.model.gpt import GPT

__all__ = ["GPT"]

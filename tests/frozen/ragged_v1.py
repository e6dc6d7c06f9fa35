"""Frozen copy of chapter 18's ragged decoding step as it was before chapter 3's cache
learned per-row lengths (git HEAD dcc71d7): tests/test_model.py checks the model's own
per-row path against it, bit for bit."""
import torch
import torch.nn.functional as F


@torch.no_grad()
def decode_step_ragged_v1(model, cache, lengths, tokens):
    """One decoding step in which every row sits at its own position -> logits [A, V].

    tokens [A] are the newest tokens, at positions lengths [A]; their keys/values go to
    slot lengths[i] of row i and each row attends to its slots 0..lengths[i]. lengths is
    advanced in place. The arithmetic is TinyAgent.forward's (same modules, same order),
    one position per row.
    """
    A, capacity = tokens.shape[0], cache.k[0].shape[2]
    if int(lengths.max()) >= capacity:
        raise ValueError(f'position {int(lengths.max())} is past the cache capacity '
                         f'{capacity}')
    rows = torch.arange(A, device=tokens.device)
    S = int(lengths.max()) + 1
    # [A, S]: row i sees its slots 0..lengths[i]
    allowed = torch.arange(S, device=tokens.device)[None, :] <= lengths[:, None]
    h = (model.tok_emb(tokens) + model.pos_emb(lengths))[:, None]        # [A, 1, D]
    for i, block in enumerate(model.blocks.layers):
        attn = block.self_attn
        qkv = attn.qkv(block.norm1(h)).view(A, 1, 3, attn.num_heads, attn.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                    # 3 x [A, H, 1, hd]
        cache.k[i][rows, :, lengths] = k[:, :, 0]               # slot = position
        cache.v[i][rows, :, lengths] = v[:, :, 0]
        out = F.scaled_dot_product_attention(
            q, cache.k[i][:, :, :S], cache.v[i][:, :, :S],
            attn_mask=allowed[:, None, None, :])                # [A, H, 1, hd]
        h = h + attn.proj(out.transpose(1, 2).reshape(A, 1, -1))
        h = h + block.mlp(block.norm2(h))
    lengths += 1
    return model.head(model.norm(h))[:, 0]                      # [A, V]

"""A frozen copy of chapter 13's traced_update before it was split into named steps (one
function of 110 lines). tests/test_diagnostics.py checks the split version against it, bit for
bit, under every bug option. Do not edit."""
import torch

import agentrl as arl


# chapter 13's row helpers as they were when this copy was frozen (packing inside)
def _update_rows(batch, advantages, pack, max_tokens):
    """The rows an update trains on -> dict: ids [R, L], action_mask / sample_logp /
    adv [R, L-1], length [R], and for packed rows position_ids, segment_ids [R, L]."""
    if pack is None:
        mask = batch['action_mask']                                  # [B, T-1]
        return dict(ids=batch['ids'], action_mask=mask,
                    sample_logp=batch['sample_logp'], length=batch['length'],
                    adv=advantages[:, None].expand_as(mask))
    trajs = [arl.Trajectory(ids=batch['ids'][i, :n],
                            action_mask=batch['action_mask'][i, :n - 1],
                            sample_logp=batch['sample_logp'][i, :n - 1], reward=0.0)
             for i, n in enumerate(batch['length'].tolist())]
    packed = arl.pack_sequences(trajs, max_tokens)
    adv = torch.zeros_like(packed['action_mask'])                    # [R, L-1]
    for r, members in enumerate(packed['rows']):
        seg = packed['segment_ids'][r, :-1]                          # [L-1]
        for k, i in enumerate(members):
            adv[r][seg == k] = advantages[i]
    R, L = packed['ids'].shape
    return dict(ids=packed['ids'], action_mask=packed['action_mask'],
                sample_logp=packed['sample_logp'], adv=adv,
                length=torch.full((R,), L), position_ids=packed['position_ids'],
                segment_ids=packed['segment_ids'])


def _update_logits(model, rows, sel, width, pack):
    """Logits [b, width, V] of the rows `sel`: padded rows with the default causal
    mask; packed rows with the block-diagonal mask ('block', correct) or with a plain
    causal mask that lets every episode attend to the ones before it ('causal')."""
    ids = rows['ids'][sel, :width]
    if pack is None:
        return model(ids)
    pos, seg = rows['position_ids'][sel, :width], rows['segment_ids'][sel, :width]
    if pack == 'block':
        return arl.packed_logits(model, ids, pos, seg)
    return model(ids, position_ids=pos)                  # causal across episodes


def traced_update_v1(model, optimizer, batch, advantages, cfg, ref_model=None,
                  generator=None, pack=None, normalize='global', old_policy=None):
    """Chapter 7's rl_update with the measurements a dashboard needs -> stats dict.

    batch: dict from collate; advantages [B]. With the defaults it trains exactly as
    arl.rl_loop.rl_update (same parameters bit for bit) and returns its stats
    (update_tokens, loss, grad_norm, clip_frac) plus, from the first epoch: entropy
    (mean per-token entropy on policy tokens), kl_ref (mean k3 estimate of
    KL(policy || ref_model), when ref_model is given), mismatch and mismatch_max (mean
    and max |old log-prob - sampler log-prob| on policy tokens), first_ratio_dev
    (max |ratio - 1|), loss_expected (the first-epoch loss when the ratio is 1:
    minus the token mean of the advantages); and from the last epoch: ratio_min,
    ratio_max, approx_kl (mean r - 1 - log r, KL(old || new)).
    Options that inject the bugs of chapter 13's gallery: pack='block' (packed rows,
    block-diagonal mask) or 'causal' (packed rows, plain causal mask: leaks);
    normalize='micro' (each micro-batch's own token mean / number of micro-batches);
    old_policy: a model whose log-probs serve as the old ones (e.g. a stale copy).
    """
    if pack not in (None, 'block', 'causal'):
        raise ValueError(f"pack must be None, 'block' or 'causal', got {pack!r}")
    if normalize not in ('global', 'micro'):
        raise ValueError(f"normalize must be 'global' or 'micro', got {normalize!r}")
    rows = _update_rows(batch, advantages, pack, cfg.max_tokens)
    mask_all = rows['action_mask']                           # [R, L-1]
    n_tokens = mask_all.sum()
    if n_tokens == 0:
        return dict(update_tokens=0, loss=0.0, grad_norm=0.0, clip_frac=0.0)
    old_logp = torch.zeros_like(mask_all)                    # [R, L-1]
    stats = dict(update_tokens=int(n_tokens),
                 loss_expected=-float((rows['adv'] * mask_all).sum() / n_tokens))
    first = dict(entropy=0.0, kl_ref=0.0, mismatch=0.0, mismatch_max=0.0,
                 first_ratio_dev=0.0)
    for epoch in range(cfg.epochs):
        model.train()
        optimizer.zero_grad()
        if generator is not None:
            order = torch.randperm(len(mask_all), generator=generator)
        else:
            order = torch.arange(len(mask_all))
        chunks = order.split(cfg.micro_batch_size)
        total, clipped = 0.0, 0.0
        last = dict(ratio_min=float('inf'), ratio_max=0.0, approx_kl=0.0)
        for sel in chunks:
            width = int(rows['length'][sel].max())           # trim padding
            mask = mask_all[sel, :width - 1]                 # [b, width-1]
            targets = rows['ids'][sel, 1:width]              # [b, width-1]
            logits = _update_logits(model, rows, sel, width, pack)[:, :-1]
            logp = arl.selected_log_probs(logits, targets)   # [b, width-1]
            if epoch == 0:
                if old_policy is None:
                    old_logp[sel, :width - 1] = logp.detach()
                else:
                    with torch.no_grad():
                        old_logits = _update_logits(old_policy, rows, sel, width,
                                                    pack)[:, :-1]
                        old_logp[sel, :width - 1] = arl.selected_log_probs(
                            old_logits, targets)
            old = old_logp[sel, :width - 1]
            ratio = torch.exp(logp - old)                    # [b, width-1]
            adv = rows['adv'][sel, :width - 1]               # [b, width-1]
            clipped_ratio = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
            objective = torch.min(ratio * adv, clipped_ratio * adv)
            if normalize == 'global':
                loss = -(objective * mask).sum() / n_tokens
            else:                # the bug: this micro-batch's own token mean
                loss = -(objective * mask).sum() / mask.sum().clamp(min=1) / len(chunks)
            loss.backward()
            total += loss.item()
            with torch.no_grad():
                out = (((ratio > 1 + cfg.clip_eps) & (adv > 0))
                       | ((ratio < 1 - cfg.clip_eps) & (adv < 0)))
                clipped += (out * mask).sum().item()
                on = mask.bool()
                r, log_r = ratio[on], (logp - old)[on]
                if r.numel():
                    last['ratio_min'] = min(last['ratio_min'], r.min().item())
                    last['ratio_max'] = max(last['ratio_max'], r.max().item())
                    last['approx_kl'] += (r - 1 - log_r).sum().item()
                if epoch == 0:
                    ent = arl.token_entropy(logits)          # [b, width-1]
                    first['entropy'] += (ent * mask).sum().item()
                    gap = (old - rows['sample_logp'][sel, :width - 1]).abs()[on]
                    if gap.numel():
                        first['mismatch'] += gap.sum().item()
                        first['mismatch_max'] = max(first['mismatch_max'],
                                                    gap.max().item())
                        first['first_ratio_dev'] = max(first['first_ratio_dev'],
                                                       (r - 1).abs().max().item())
                    if ref_model is not None:
                        ref = _update_logits(ref_model, rows, sel, width, pack)
                        ref_logp = arl.selected_log_probs(ref[:, :-1], targets)
                        # [b, width-1]
                        k3 = arl.kl_estimate(logp, ref_logp, 'k3')
                        first['kl_ref'] += (k3 * mask).sum().item()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         cfg.max_grad_norm))
        optimizer.step()
        if epoch == 0:
            stats.update(loss=total, grad_norm=grad_norm)
        stats['clip_frac'] = clipped / n_tokens.item()       # of the last step
        stats.update(ratio_min=last['ratio_min'], ratio_max=last['ratio_max'],
                     approx_kl=last['approx_kl'] / n_tokens.item())
    model.eval()
    n = n_tokens.item()
    stats.update(entropy=first['entropy'] / n, mismatch=first['mismatch'] / n,
                 mismatch_max=first['mismatch_max'],
                 first_ratio_dev=first['first_ratio_dev'])
    if ref_model is not None:
        stats['kl_ref'] = first['kl_ref'] / n
    return stats


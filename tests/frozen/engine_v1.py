"""Frozen copies of the RL engine before it became one update and one loop (issue 22).

`rl_update_v1` is chapter 9's `rl_update` as it was (`#@save redefine` of chapter 7's, with
`getattr` duck typing on the config), `train_rl_v1` chapter 10's `train_rl` (a redefinition of
chapter 7's with two hooks). Every cached run of chapters 7-16 was trained by these two.
tests/test_engine.py checks that chapter 7's one update with chapter 9's parts, and chapter
7's one loop with its hooks, give the same weights and stats bit for bit. Do not edit.
"""
import torch
from tqdm.auto import tqdm

import agentrl as arl


def rl_update_v1(model, optimizer, batch, advantages, cfg, ref_model=None, generator=None):
    """Chapter 7's rl_update with a KL penalty to ref_model and an entropy bonus
    -> stats dict.

    batch: dict from collate (ids [B, T], action_mask [B, T-1], length [B]);
    advantages [B]. cfg: a KLConfig (a plain RLConfig means no penalty and no bonus:
    then the update is chapter 7's, bit for bit). Stats: chapter 7's (update_tokens,
    loss, grad_norm, clip_frac) plus entropy (mean exact entropy of pi per policy token)
    and kl_ref (mean k3 estimate of KL(pi || ref) per policy token, when ref_model is
    given), both from the first epoch's forward pass, and ratio_min / ratio_max (of
    pi / pi_old over the policy tokens of the last epoch; 1.0 with one epoch).
    """
    kl_coef = getattr(cfg, 'kl_coef', 0.0)
    kl_estimator = getattr(cfg, 'kl_estimator', 'k3')
    kl_mode = getattr(cfg, 'kl_mode', 'loss')
    entropy_coef = getattr(cfg, 'entropy_coef', 0.0)
    if kl_coef > 0 and ref_model is None:
        raise ValueError('ref_model is None but cfg.kl_coef > 0: the KL penalty needs '
                         'a reference model')
    mask_all = batch['action_mask']                          # [B, T-1]
    n_tokens = mask_all.sum()
    if n_tokens == 0:      # nothing measured: no entropy or kl_ref
        return dict(update_tokens=0, loss=0.0, grad_norm=0.0, clip_frac=0.0,
                    ratio_min=1.0, ratio_max=1.0)
    # [B, T-1] each, filled by the first step
    old_logp = torch.zeros_like(mask_all)
    ref_logp = torch.zeros_like(mask_all)
    stats = dict(update_tokens=int(n_tokens))
    if ref_model is not None:
        ref_model.eval()
    for epoch in range(cfg.epochs):
        model.train()
        optimizer.zero_grad()
        if generator is not None:
            order = torch.randperm(len(mask_all), generator=generator)
        else:
            order = torch.arange(len(mask_all))
        total, clipped, entropy, kl_ref = 0.0, 0.0, 0.0, 0.0
        r_min, r_max = float('inf'), 0.0
        for rows in order.split(cfg.micro_batch_size):
            width = int(batch['length'][rows].max())         # trim padding
            ids, mask = batch['ids'][rows, :width], mask_all[rows, :width - 1]
            sl = (rows, slice(0, width - 1))
            logits = model(ids)                              # [b, width, V]
            # the ops of arl.sequence_log_probs: [b, width-1]
            logp = arl.selected_log_probs(logits[:, :-1], ids[:, 1:])
            if epoch == 0:
                old_logp[sl] = logp.detach()
                with torch.no_grad():
                    ent = arl.token_entropy(logits[:, :-1])      # [b, width-1]
                    entropy += (ent * mask).sum().item()
                    if ref_model is not None:
                        ref_logp[sl] = arl.sequence_log_probs(ref_model, ids)
                        k3 = arl.kl_estimate(logp, ref_logp[sl], 'k3')
                        kl_ref += (k3 * mask).sum().item()
            # 1 in value at the first step
            ratio = torch.exp(logp - old_logp[sl])
            adv = advantages[rows][:, None]                  # [b, 1]
            if kl_coef > 0 and kl_mode == 'reward':
                # per-token penalty from the policy the batch was sampled with
                penalty = arl.kl_estimate(old_logp[sl], ref_logp[sl], kl_estimator)
                adv = adv - kl_coef * penalty                # [b, width-1]
            clipped_ratio = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
            objective = torch.min(ratio * adv, clipped_ratio * adv)
            loss = -(objective * mask).sum() / n_tokens
            if kl_coef > 0 and kl_mode == 'loss':
                kl = arl.kl_estimate(logp, ref_logp[sl], kl_estimator)
                loss = loss + kl_coef * (kl * mask).sum() / n_tokens
            if entropy_coef > 0:
                ent_grad = arl.token_entropy(logits[:, :-1])     # [b, width-1], with grad
                loss = loss - entropy_coef * (ent_grad * mask).sum() / n_tokens
            loss.backward()
            total += loss.item()
            with torch.no_grad():
                out = (((ratio > 1 + cfg.clip_eps) & (adv > 0))
                       | ((ratio < 1 - cfg.clip_eps) & (adv < 0)))
                clipped += (out * mask).sum().item()
                on = ratio[mask.bool()]
                if on.numel():
                    r_min = min(r_min, on.min().item())
                    r_max = max(r_max, on.max().item())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         cfg.max_grad_norm))
        optimizer.step()
        if epoch == 0:
            stats.update(loss=total, grad_norm=grad_norm,
                         entropy=entropy / n_tokens.item())
            if ref_model is not None:
                stats['kl_ref'] = kl_ref / n_tokens.item()
        stats['clip_frac'] = clipped / n_tokens.item()       # of the last step
        if cfg.epochs == 1:
            r_min, r_max = 1.0, 1.0
        stats.update(ratio_min=r_min, ratio_max=r_max)
    model.eval()
    return stats



def train_rl_v1(model, tasks, tok, cfg, steps, eval_tasks=None, eval_every=10, eval_n=8,
             ref_model=None, progress=True, transform=None, update_fn=None):
    """Chapter 7's RL loop with two hooks -> history (the same records).

    transform(sampled, step) -> list of Trajectory: applied to each step's sampled
    episodes before the groups with equal rewards are dropped; it may rescore rewards
    (chapter 10), change action masks or drop episodes (chapter 11). It must keep each
    group's episodes consecutive and must not draw from the training generator. The
    behaviour recorded per step is that of the transformed episodes: 'reward' is then
    the rescored reward, while the outcome shares (share_correct...) stay the
    environment's.
    update_fn: used instead of arl.rl_update (same signature), e.g. to inject a bug
    (chapter 13). With both None this is chapter 7's train_rl, bit for bit.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f'steps must be an int >= 1, got {steps!r}')
    if transform is not None and not callable(transform):
        raise TypeError(f'transform must be callable or None, got {type(transform)}')
    if update_fn is not None and not callable(update_fn):
        raise TypeError(f'update_fn must be callable or None, got {type(update_fn)}')
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    if cfg.lr_schedule == 'linear':
        decay = lambda s: 1 - s / steps
    else:
        decay = lambda s: 1.0
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    env_fn = lambda: arl.make_env(cfg)

    def evaluate(step):
        return arl.evaluate(model, eval_tasks, tok, eval_n,
                            generator=torch.Generator().manual_seed(step), cfg=cfg)

    history = []
    for step in tqdm(range(steps), desc=f'RL seed {cfg.seed}', disable=not progress):
        record = dict(step=step, lr=optimizer.param_groups[0]['lr'])
        if eval_tasks is not None and step % eval_every == 0:
            record['heldout'] = evaluate(step)
        kept, sampled = arl.sample_step(model, env_fn, tasks, tok, cfg, gen)
        if transform is not None:
            sampled = transform(sampled, step)
            kept = arl.informative_groups(sampled)
        record.update(arl.behavior_stats(sampled), kept=len(kept), sampled=len(sampled))
        if kept:
            batch = arl.collate(kept, tok.pad_id)
            advantages = arl.compute_advantages(batch, cfg)
            update = rl_update_v1 if update_fn is None else update_fn
            record.update(update(model, optimizer, batch, advantages, cfg,
                                 ref_model, gen))
        schedule.step()
        history.append(record)
    if eval_tasks is not None:
        history.append(dict(step=steps, heldout=evaluate(steps)))
    return history


"""Frozen copies of the RL trainers of chapters 8, 14 and 16 before they became parts
and hooks of chapter 7's one update and one loop (issue 22, part 1).

`ppo_update_v1` is chapter 8's update (old log-probs recomputed before the first step,
truncated IS weights, one stats dict per epoch), `train_curriculum_v1` chapter 14's loop
and `train_rl_quantized_rollout_v1` chapter 16's. Every cached run of those chapters was
trained by them; tests/test_engine.py checks that the compositions replacing them give
the same weights bit for bit. Do not edit.
"""
import torch
from tqdm.auto import tqdm

import agentrl as arl
from frozen.engine_v1 import rl_update_v1


def filter_by_pass_rate(tasks, pass_rates, low=0.0, high=1.0):
    return arl.filter_by_pass_rate(tasks, pass_rates, low, high)


def quantize_model(model, fmt):
    return arl.quantize_model(model, fmt)


def importance_ratio_v1(logp, old_logp, mask):
    """Per-token ratio exp(logp - old_logp) on policy tokens, 1 elsewhere.

    logp, old_logp, mask [B, T] -> [B, T].
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f'logp, old_logp and mask must have one shape, got '
                         f'{tuple(logp.shape)}, {tuple(old_logp.shape)} and '
                         f'{tuple(mask.shape)}')
    return torch.where(mask.bool(), (logp - old_logp).exp(), torch.ones_like(logp))


def clipped_loss_v1(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.2,
                 norm_const=None, weights=None):
    """PPO/GRPO clipped surrogate -> (loss, stats).

    logp [B, T]: log-probs of the sampled tokens under the model being trained (with
    grad); old_logp [B, T]: the same under the policy the update started from (no grad);
    adv [B] or [B, T]; mask [B, T] (1 on policy tokens); weights [B, T]: optional
    per-token factors (e.g. truncated IS weights), default 1.
    loss = -sum(min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) * weights * mask)
    / norm_const, with r = exp(logp - old_logp); norm_const defaults to mask.sum() (a
    token mean). clip_low = clip_high = None gives the unclipped importance-weighted
    loss. stats (floats): clip_frac (share of policy tokens whose gradient the clip
    removes), ratio_min, ratio_max, approx_kl (mean of r - 1 - log r, an estimate of
    KL(old || new)).
    """
    ratio = importance_ratio_v1(logp, old_logp, mask)                     # [B, T]
    # [B, 1] or [B, T]
    adv = adv[:, None] if adv.dim() == 1 else adv
    if adv.shape[0] != logp.shape[0]:
        raise ValueError(f'adv has {adv.shape[0]} rows, logp has {logp.shape[0]}')
    weights = torch.ones_like(mask) if weights is None else weights
    if clip_low is None:
        objective, clipped = ratio * adv, torch.zeros_like(mask, dtype=torch.bool)
    else:
        if clip_high is None or not (0 <= clip_low < 1 and clip_high >= 0):
            raise ValueError(f'need 0 <= clip_low < 1 and clip_high >= 0, got '
                             f'{clip_low}, {clip_high}')
        clamped = ratio.clamp(1 - clip_low, 1 + clip_high)
        objective = torch.min(ratio * adv, clamped * adv)
        # the tokens whose gradient the clip sets to zero
        clipped = (((ratio > 1 + clip_high) & (adv > 0))
                   | ((ratio < 1 - clip_low) & (adv < 0)))
    norm_const = mask.sum().clamp(min=1) if norm_const is None else norm_const
    loss = -(objective * weights * mask).sum() / norm_const
    with torch.no_grad():
        on = mask.bool()
        n = on.sum().clamp(min=1)
        r, log_r = ratio[on], (logp - old_logp)[on]
        stats = dict(clip_frac=(clipped & on).sum().item() / n.item(),
                     ratio_min=r.min().item() if r.numel() else 1.0,
                     ratio_max=r.max().item() if r.numel() else 1.0,
                     approx_kl=(r - 1 - log_r).sum().item() / n.item())
    return loss, stats


def truncated_is_weights_v1(trainer_logp, sample_logp, mask, cap=2.0):
    """Token-level truncated importance weights min(pi_trainer / mu_sampler, cap).

    trainer_logp, sample_logp, mask [B, T] -> [B, T], 0 off the mask, without grad.
    """
    if not cap > 0:
        raise ValueError(f'cap must be > 0, got {cap}')
    with torch.no_grad():
        ratio = importance_ratio_v1(trainer_logp, sample_logp, mask)       # [B, T]
        return ratio.clamp(max=cap) * mask


@torch.no_grad()
def batch_log_probs_v1(model, batch, micro_batch_size=64):
    """Log-probs of every next token of batch['ids'] [B, T] under `model` -> [B, T-1].

    Computed in chunks of micro_batch_size rows.
    """
    rows_all = torch.arange(len(batch['ids']))
    return torch.cat([arl.sequence_log_probs(model, batch['ids'][rows])
                      for rows in rows_all.split(micro_batch_size)])


def ppo_update_v1(model, optimizer, batch, advantages, cfg, epochs=4, clip=0.2,
               tis_cap=None, generator=None):
    """`epochs` clipped-surrogate optimiser steps on one batch -> stats per epoch.

    batch: dict from collate (ids [B, T]; action_mask, sample_logp [B, T-1]; length
    [B]); advantages [B]. The old log-probs are recomputed with `model` before the first
    step, so the first ratio is 1 up to float rounding. With tis_cap, every token is
    also weighted by min(pi_old / mu_sampler, tis_cap) from batch['sample_logp'].
    Micro-batches of cfg.micro_batch_size rows are normalised by the batch's
    policy-token count, so their gradients add up to the full batch's; gradients are
    clipped to cfg.max_grad_norm. clip=None: no clipping. Returns one stats dict per
    epoch; the stats of an epoch describe the ratios seen by that epoch's forward pass
    (before its step).
    """
    if epochs < 1:
        raise ValueError(f'epochs must be >= 1, got {epochs}')
    mask = batch['action_mask']                                            # [B, T-1]
    n_tokens = mask.sum()
    old_logp = batch_log_probs_v1(model, batch, cfg.micro_batch_size)         # [B, T-1]
    if tis_cap is None:
        weights = mask
    else:
        weights = truncated_is_weights_v1(old_logp, batch['sample_logp'], mask, tis_cap)
    history = []
    for epoch in range(epochs):
        model.train()
        optimizer.zero_grad()
        if generator is not None:
            rows_all = torch.randperm(len(mask), generator=generator)
        else:
            rows_all = torch.arange(len(mask))
        totals = dict(loss=0.0, clip_frac=0.0, approx_kl=0.0, ratio_min=float('inf'),
                      ratio_max=0.0)
        for rows in rows_all.split(cfg.micro_batch_size):
            width = int(batch['length'][rows].max())                      # trim padding
            sl = (rows, slice(0, width - 1))
            # [b, width-1]
            logp = arl.sequence_log_probs(model, batch['ids'][rows, :width])
            loss, stats = clipped_loss_v1(logp, old_logp[sl], advantages[rows], mask[sl],
                                       clip, clip, norm_const=n_tokens,
                                       weights=weights[sl])
            loss.backward()
            share = mask[sl].sum().item() / n_tokens.item()   # token-weighted averages
            totals['loss'] += loss.item()
            totals['clip_frac'] += stats['clip_frac'] * share
            totals['approx_kl'] += stats['approx_kl'] * share
            totals['ratio_min'] = min(totals['ratio_min'], stats['ratio_min'])
            totals['ratio_max'] = max(totals['ratio_max'], stats['ratio_max'])
        params = model.parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        history.append(dict(epoch=epoch, grad_norm=float(grad_norm), **totals))
    model.eval()
    return history


def train_curriculum_v1(model, tasks, tok, cfg, steps, low=0.0, high=1.0, revisit=1,
                     eval_tasks=None, eval_every=10, eval_n=8, progress=True):
    """RL (Chapter 7's loop) that samples only tasks whose estimated pass rate is in
    (low, high), plus `revisit` random excluded tasks per step -> history (a dict per
    step).

    Every task starts at an estimate of 0.5 (unknown, so in the pool); each sampled
    group replaces its task's estimate with the group's pass rate. The learning rate
    follows cfg.lr_schedule, as in train_rl. history: pool, n_episodes, episodes
    (sampled before this step), zero_adv_frac (share of groups with equal rewards),
    kept, lr, behaviour stats and update stats. With eval_tasks, a record also holds
    'heldout' (arl.evaluate on eval_tasks, eval_n episodes each, generator seeded by
    the step, as in train_rl) every eval_every steps, measured before the step
    trains, and a last record dict(step=steps, episodes, heldout) follows the last
    step. progress=False hides the progress bar.
    """
    for name, value, least in (('steps', steps, 1), ('revisit', revisit, 0),
                               ('eval_every', eval_every, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f'{name} must be an int >= {least}, got {value!r}')
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    # train_rl's schedule, set by hand (a step that keeps no group makes no
    # optimiser step, and a scheduler would warn)
    linear = cfg.lr_schedule == 'linear'
    env_fn = lambda: arl.make_env(cfg)

    def evaluate(step):
        return arl.evaluate(model, eval_tasks, tok, eval_n,
                            generator=torch.Generator().manual_seed(step), cfg=cfg)

    estimate = {task.name: 0.5 for task in tasks}
    G, history, episodes = cfg.group_size, [], 0
    bar = tqdm(range(steps), desc='curriculum', leave=False, disable=not progress)
    for step in bar:
        lr = cfg.lr * (1 - step / steps) if linear else cfg.lr
        for group in optimizer.param_groups:
            group['lr'] = lr
        record = dict(step=step, episodes=episodes, lr=lr)
        if eval_tasks is not None and step % eval_every == 0:
            record['heldout'] = evaluate(step)
        pool = filter_by_pass_rate(tasks, [estimate[t.name] for t in tasks], low, high)
        names = {t.name for t in pool}
        excluded = [t for t in tasks if t.name not in names]
        pick = torch.randperm(len(excluded), generator=gen)[:revisit].tolist()
        candidates = pool + [excluded[i] for i in pick]
        kept, sampled = (arl.sample_step(model, env_fn, candidates, tok, cfg, gen)
                         if candidates else ([], []))
        flat = 0
        for g in range(0, len(sampled), G):
            rewards = [t.reward for t in sampled[g:g + G]]
            estimate[sampled[g].info['task']] = sum(rewards) / len(rewards)
            flat += len(set(rewards)) == 1
        record.update(pool=len(pool), n_episodes=len(sampled), kept=len(kept),
                      zero_adv_frac=flat / max(len(sampled) // G, 1),
                      **arl.behavior_stats(sampled))
        if kept:
            batch = arl.collate(kept, tok.pad_id)
            advantages = arl.compute_advantages(batch, cfg)
            stats = rl_update_v1(model, optimizer, batch, advantages, cfg, None, gen)
            record.update(stats)
        episodes += len(sampled)
        history.append(record)
    if eval_tasks is not None:
        history.append(dict(step=steps, episodes=episodes, heldout=evaluate(steps)))
    return history


def train_rl_quantized_rollout_v1(model, tasks, tok, cfg, steps, rollout_fmt='mxfp4',
                               tis_cap=None, eval_tasks=None, eval_every=10,
                               eval_n=8, progress=True):
    """RL in which quantize_model(model, rollout_fmt) samples every step and the
    float32 `model` trains on its episodes, in place -> history.

    history: train_rl's records, plus per step the mismatch on the kept batch
    (mismatch_abs_log: mean |log rho|; mismatch_share: share of policy tokens with
    |rho - 1| > 0.2, rho = pi_trainer / mu_sampler). The update is chapter 8's
    ppo_update (cfg.epochs steps, clip cfg.clip_eps); tis_cap: truncated IS cap.
    Held-out evaluations (eval_tasks) use the float32 model.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f'steps must be an int >= 1, got {steps!r}')
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f'tis_cap must be None or > 0, got {tis_cap!r}')
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
    for step in tqdm(range(steps), desc=f'{rollout_fmt} rollout',
                     disable=not progress):
        record = dict(step=step, lr=optimizer.param_groups[0]['lr'])
        if eval_tasks is not None and step % eval_every == 0:
            record['heldout'] = evaluate(step)
        sampler = quantize_model(model, rollout_fmt)       # fresh weights each step
        kept, sampled = arl.sample_step(sampler, env_fn, tasks, tok, cfg, gen)
        record.update(arl.behavior_stats(sampled), kept=len(kept),
                      sampled=len(sampled))
        if kept:
            batch = arl.collate(kept, tok.pad_id)
            on = batch['action_mask'].bool()
            log_rho = (batch_log_probs_v1(model, batch, cfg.micro_batch_size)
                       - batch['sample_logp'])[on]                         # [N]
            record.update(mismatch_abs_log=log_rho.abs().mean().item(),
                          mismatch_share=((log_rho.exp() - 1).abs() > 0.2)
                          .float().mean().item())
            advantages = arl.compute_advantages(batch, cfg)
            epochs = ppo_update_v1(model, optimizer, batch, advantages, cfg,
                                    cfg.epochs, cfg.clip_eps, tis_cap, gen)
            record.update(loss=epochs[0]['loss'], grad_norm=epochs[0]['grad_norm'])
        schedule.step()
        history.append(record)
    if eval_tasks is not None:
        history.append(dict(step=steps, heldout=evaluate(steps)))
    return history

"""Frozen copy of chapter 15's distillation loop as it was before it became chapter 7's
train_rl with a sampler and an update part (git HEAD e24b2da): tests/test_engine.py checks
that train_opd now trains the same weights, bit for bit."""
import torch
from tqdm.auto import tqdm

import agentrl as arl


def distill_gradients_v1(student, teachers, trajs, tok, cfg, n_tokens):
    """One step's distillation gradient, accumulated into the student's .grad ->
    totals (loss, reverse_kl, forward_kl, entropy: per policy token).

    Every trajectory is routed to its family's teacher (route_by_family) and
    distill_loss runs on micro-batches of cfg.micro_batch_size, each normalised by
    the whole step's n_tokens, so the sum of the micro-batches' gradients is the
    batch gradient. train_opd's default gradient_fn; chapter 17 computes the same
    gradient through its teacher store and scheduler.
    """
    totals = dict(loss=0.0, reverse_kl=0.0, forward_kl=0.0, entropy=0.0)
    for family, idx in arl.route_by_family(trajs, teachers):
        for part in torch.tensor(idx).split(cfg.micro_batch_size):
            batch = arl.collate([trajs[i] for i in part], tok.pad_id)
            loss, stats = arl.distill_loss(
                student, teachers[family], batch['ids'], batch['action_mask'],
                cfg.beta, n_tokens, cfg.loss, cfg.teacher_temperature)
            loss.backward()
            totals['loss'] += loss.item()
            for k, v in stats.items():
                totals[k] += v / n_tokens
    return totals


def train_opd_v1(student, teachers, tasks, tok, cfg, steps, eval_tasks=None,
              eval_every=10, eval_n=8, progress=True, gradient_fn=distill_gradients_v1):
    """On-policy distillation from many teachers, training `student` in place ->
    history.

    Each step picks cfg.tasks_per_step tasks; with probability cfg.lam the student
    samples cfg.group_size episodes of each (arl.sample_groups), else each task's
    family teacher samples them (off-policy). Every trajectory is routed to its
    family's teacher (route_by_family) and one optimiser step is taken on
    distill_loss. history: one dict per step (episodes: student episodes sampled,
    teacher_episodes, per-token loss, reverse_kl, forward_kl, entropy, the sampled
    episodes' behaviour), plus 'heldout' (arl.evaluate with eval_n episodes per task)
    every eval_every steps (eval_every=0: none) and after the last.
    gradient_fn(student, teachers, trajs, tok, cfg, n_tokens) -> dict accumulates
    the step's gradient and returns what the record shows of it
    (distill_gradients unless given).
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f'steps must be an int >= 1, got {steps!r}')
    if not tasks:
        raise ValueError('tasks is empty')
    if not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f'eval_every must be an int >= 0, got {eval_every!r}')
    missing = sorted({t.family for t in tasks} - set(teachers))
    if missing:
        raise ValueError(f'no teacher for families {missing}')
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(student.parameters(), lr=cfg.lr)
    env_fn = lambda: arl.make_env(cfg)

    def evaluate(step):     # the start is the same for every run from one student
        if step == 0:
            return arl.evaluate_once(student, eval_tasks, tok, eval_n, 0, cfg)
        return arl.evaluate(student, eval_tasks, tok, eval_n,
                            generator=torch.Generator().manual_seed(step), cfg=cfg)

    history = []
    for step in tqdm(range(steps), desc='OPD', disable=not progress):
        record = dict(step=step)
        if eval_tasks is not None and eval_every and step % eval_every == 0:
            record['heldout'] = evaluate(step)
        pick = torch.randperm(len(tasks), generator=gen)[:cfg.tasks_per_step].tolist()
        picked = [tasks[i] for i in pick]
        on_policy = bool(torch.rand(1, generator=gen) < cfg.lam)
        if on_policy:
            trajs = arl.sample_groups(student, env_fn, picked, tok, cfg, gen)
        else:                       # each family's teacher writes its episodes
            trajs = [traj for family, model in teachers.items()
                     for traj in arl.sample_groups(
                         model, env_fn, [t for t in picked if t.family == family],
                         tok, cfg, gen)]
        record.update(arl.behavior_stats(trajs), on_policy=on_policy,
                      episodes=len(trajs) if on_policy else 0,
                      teacher_episodes=0 if on_policy else len(trajs))
        n_tokens = sum(float(t.action_mask.sum()) for t in trajs)
        if n_tokens == 0:
            raise RuntimeError(f'step {step}: the episodes hold no policy token')
        student.train()
        optimizer.zero_grad()
        totals = gradient_fn(student, teachers, trajs, tok, cfg, n_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(),
                                                   cfg.max_grad_norm)
        optimizer.step()
        student.eval()
        record.update(totals, grad_norm=float(grad_norm))
        history.append(record)
    if eval_tasks is not None:
        history.append(dict(step=steps, heldout=evaluate(steps)))
    return history

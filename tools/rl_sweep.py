"""The tuning runs behind chapter 7's RLConfig defaults: a small grid around them, several seeds.

Each setting changes one default of arl.RLConfig; each run trains a copy of the RL base (chapter 5)
for --steps steps exactly as chapter 7's `train` cell does, through arl.train_rl_cached with the
chapter's held-out evaluation (all held-out tasks x 16 episodes at steps 0, 20, 40 and the last), so
the runs at the default setting are the chapter's own runs and are shared through the cache. For
every run it records the held-out curve, the final pass rate, greedy pass rate and pass@8, the gain
over the base with its 95% paired bootstrap interval over tasks (arl.compare_evaluations), the
per-family rates and the final per-task rates (so that a reader of the file can compare settings task
by task); each setting's summary pairs its seeds with the base by arl.seed_paired (chapter 7's t
interval over seeds and tasks). Runs go two at a time, one per core (arl.parallel_map). The results
go to a JSON file (default chapters/07_rl_loop/sweep.json) that chapter 7 prints; it records the
code hash of chapters 1-7, and chapter 7 refuses a sweep run on other code.

    .venv/bin/python tools/rl_sweep.py                 # the full grid: 6 settings x 4 seeds
    .venv/bin/python tools/rl_sweep.py --steps 4 --seeds 0 --out /tmp/sweep.json   # smoke test

A cold run costs as much as one seed of chapter 7's training (about half a minute on an idle
core), so the grid takes several minutes; cached runs (same code, base, tasks and settings) load in
milliseconds. Runs use one torch thread (arl.set_torch_threads), like the book's notebooks. Like
every RL run, the results depend on the CPU's float rounding in their details; the intervals say
which differences are larger than the noise of the evaluation, the seeds show the noise of training.
"""
import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import agentrl as arl  # noqa: E402

# name -> the RLConfig fields it changes (one at a time, everything else at the defaults)
SETTINGS = {
    'default': {},
    'tasks_per_step=16': dict(tasks_per_step=16),
    "lr_schedule='constant'": dict(lr_schedule='constant'),
    'lr=3e-3': dict(lr=3e-3),
    'epochs=1': dict(epochs=1),
    'epochs=4': dict(epochs=4),
}
EVAL_EVERY, EVAL_N = 20, 16          # as in chapter 7's `train` cell


def run(base, tok, train_tasks, heldout_tasks, changes, seed, steps):
    """One (cached) training run -> (the base's evaluation, the run's record)."""
    cfg = arl.RLConfig(seed=seed, **changes)
    start = time.perf_counter()
    _, history = arl.train_rl_cached(base, train_tasks, tok, cfg, steps,
                                     eval_tasks=heldout_tasks, eval_every=EVAL_EVERY,
                                     eval_n=EVAL_N)
    seconds = time.perf_counter() - start
    evals = [h for h in history if 'heldout' in h]
    first, last = evals[0]['heldout'], evals[-1]['heldout']
    cmp = arl.compare_evaluations(first, last)
    record = dict(
        seed=seed, seconds=round(seconds, 1),
        curve=[[h['step'], h['heldout']['pass_rate']] for h in evals],
        final_pass_rate=last['pass_rate'], final_interval=last['interval'],
        final_greedy=last['greedy'], final_pass_at_8=last['pass_at_k'][7],
        gain=cmp['diff'], gain_interval=cmp['interval'],
        greedy_gain=cmp['greedy_diff'], greedy_gain_interval=cmp['greedy_interval'],
        family_gain={f: dict(diff=v['diff'], interval=v['interval'])
                     for f, v in cmp['per_family'].items()},
        final_per_family=last['per_family'], final_per_task=last['per_task'],
        final_greedy_per_task=last['greedy_per_task'],
        episodes=sum(h['sampled'] for h in history if 'sampled' in h))
    return first, record


def summarise(runs, base_eval):
    """A setting's seeds: mean and spread of their gains, and their gain over the base paired
    by seed and task (arl.seed_paired: 95% t interval over seeds and tasks; with one seed,
    arl.compare_evaluations over tasks) for the pass rate, the greedy pass rate and each
    family."""
    gains = torch.tensor([r['gain'] for r in runs], dtype=torch.float64)
    family_of = base_eval['family_of']

    def gain(key, base_key, family=None):
        names = [t for t in base_eval[base_key] if family in (None, family_of[t])]
        pick = lambda rates: dict(per_task={t: rates[t] for t in names},
                                  family_of={t: family_of[t] for t in names})
        base, finals = pick(base_eval[base_key]), [pick(r[key]) for r in runs]
        if len(runs) == 1:
            c = arl.compare_evaluations(base, finals[0])
        else:
            c = arl.seed_paired([base] * len(runs), finals)
        return dict(diff=c['diff'], interval=c['interval'])

    overall = gain('final_per_task', 'per_task')
    greedy = gain('final_greedy_per_task', 'greedy_per_task')
    return dict(mean_gain=gains.mean().item(), mean_gain_interval=overall['interval'],
                seed_std=gains.std().item() if len(gains) > 1 else float('nan'),
                min_gain=gains.min().item(), max_gain=gains.max().item(),
                greedy_gain=greedy['diff'], greedy_gain_interval=greedy['interval'],
                family_gain={f: gain('final_per_task', 'per_task', f)
                             for f in dict.fromkeys(family_of.values())})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2, 3])
    parser.add_argument('--settings', nargs='+', default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument('--out', default=str(REPO / 'chapters' / '07_rl_loop' / 'sweep.json'))
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f'--steps must be >= 1, got {args.steps}')

    arl.set_torch_threads()
    torch.manual_seed(0)
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    train_tasks, heldout_tasks = arl.make_tasks('train'), arl.make_tasks('heldout')
    base = arl.make_rl_base(tok)
    command = 'python tools/rl_sweep.py ' + ' '.join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    result = dict(
        command=command.strip(),
        started=datetime.datetime.now().isoformat(timespec='seconds'),
        steps=args.steps, seeds=args.seeds, eval_every=EVAL_EVERY, eval_n=EVAL_N,
        heldout_tasks=len(heldout_tasks), rl_base=arl.rl_base_path(tok).name,
        rl_base_recipe=arl.RL_BASE_RECIPE,
        code_hash=arl.code_hash(), torch=torch.__version__, machine=platform.machine(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        settings={})
    keys = [(name, seed) for name in args.settings for seed in args.seeds]
    done = dict(zip(keys, arl.parallel_map(          # one run per core at a time
        lambda k: run(base, tok, train_tasks, heldout_tasks, SETTINGS[k[0]], k[1],
                      args.steps), keys)))
    for name in args.settings:
        runs = []
        for seed in args.seeds:
            first, record = done[name, seed]
            # the step-0 evaluation is the base with the same random stream in every run
            base_eval = dict(pass_rate=first['pass_rate'], interval=first['interval'],
                             greedy=first['greedy'], pass_at_8=first['pass_at_k'][7],
                             per_family=first['per_family'], per_task=first['per_task'],
                             greedy_per_task=first['greedy_per_task'],
                             family_of=first['family_of'])
            if result.setdefault('base', base_eval) != base_eval:
                raise RuntimeError('the base evaluation differs between runs')
            runs.append(record)
            lo, hi = record['gain_interval']
            print(f"{name:<24} seed {seed}: gain {record['gain']:+.3f} "
                  f"[{lo:+.3f}, {hi:+.3f}] in {record['seconds']:.0f} s", flush=True)
        result['settings'][name] = dict(changes=SETTINGS[name], runs=runs,
                                        summary=summarise(runs, result['base']))
    result['finished'] = datetime.datetime.now().isoformat(timespec='seconds')
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + '\n', encoding='utf-8')
    print(f'wrote {out}')


if __name__ == '__main__':
    main()

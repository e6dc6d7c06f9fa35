"""The tuning runs behind chapter 7's RLConfig defaults: a small grid around them, several seeds.

Each setting changes one default of arl.RLConfig; each run trains a copy of the RL base (chapter 5)
for --steps steps exactly as chapter 7's `train` cell does (held-out evaluation of 40 tasks x 16
episodes at steps 0, 20, 40 and the last) and records the held-out pass rates, the gain over the
base with its paired standard error over tasks, the per-family rates and the wall time. The
results go to a JSON file (default chapters/07_rl_loop/sweep.json) that chapter 7 prints.

    .venv/bin/python tools/rl_sweep.py                 # the full grid: 6 settings x 3 seeds
    .venv/bin/python tools/rl_sweep.py --steps 4 --seeds 0 --out /tmp/sweep.json   # smoke test

Each run costs about as much as one seed of chapter 7's training, so the grid takes several
minutes. Runs use one torch thread (arl.set_torch_threads), like the book's notebooks. Like every
RL run, the results depend on the CPU's float rounding in their details; the intervals the chapter
prints say which differences are larger than that noise.
"""
import argparse
import copy
import datetime
import json
import math
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


def paired_gain(before, after):
    """Mean and standard error over tasks of the per-task differences after - before."""
    d = torch.tensor([after[k] - before[k] for k in before], dtype=torch.float64)
    return d.mean().item(), d.std().item() / math.sqrt(len(d))


def run(base, tok, train_tasks, heldout_tasks, changes, seed, steps):
    """One training run -> (the base's evaluation, the run's record: held-out curve, gain
    with its paired SE, final per-family and per-task pass rates)."""
    model = copy.deepcopy(base)
    cfg = arl.RLConfig(seed=seed, **changes)
    start = time.perf_counter()
    history = arl.train_rl(model, train_tasks, tok, cfg, steps, eval_tasks=heldout_tasks,
                           eval_every=EVAL_EVERY, eval_n=EVAL_N, progress=False)
    seconds = time.perf_counter() - start
    evals = [h for h in history if 'heldout' in h]
    first, last = evals[0]['heldout'], evals[-1]['heldout']
    gain, se = paired_gain(first['per_task'], last['per_task'])
    record = dict(seed=seed, seconds=round(seconds, 1),
                  curve=[[h['step'], h['heldout']['pass_rate']] for h in evals],
                  final_pass_rate=last['pass_rate'], gain=gain, gain_se=se,
                  final_per_family=last['per_family'], final_per_task=last['per_task'],
                  episodes=sum(h['sampled'] for h in history if 'sampled' in h))
    return first, record


def summarise(runs):
    """Seed mean and spread of a setting's gains."""
    gains = torch.tensor([r['gain'] for r in runs], dtype=torch.float64)
    return dict(mean_gain=gains.mean().item(),
                seed_std=gains.std().item() if len(gains) > 1 else float('nan'),
                min_gain=gains.min().item(), max_gain=gains.max().item(),
                mean_paired_se=sum(r['gain_se'] for r in runs) / len(runs))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
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
        torch=torch.__version__, machine=platform.machine(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        settings={})
    for name in args.settings:
        runs = []
        for seed in args.seeds:
            first, record = run(base, tok, train_tasks, heldout_tasks, SETTINGS[name], seed,
                                args.steps)
            # the step-0 evaluation is the base with the same random stream in every run
            base_eval = dict(pass_rate=first['pass_rate'], stderr=first['stderr'],
                             per_family=first['per_family'], per_task=first['per_task'])
            if result.setdefault('base', base_eval) != base_eval:
                raise RuntimeError('the base evaluation differs between runs')
            runs.append(record)
            print(f"{name:<24} seed {seed}: gain {record['gain']:+.3f} "
                  f"(paired SE {record['gain_se']:.3f}) in {record['seconds']:.0f} s",
                  flush=True)
        result['settings'][name] = dict(changes=SETTINGS[name], runs=runs,
                                        summary=summarise(runs))
    result['finished'] = datetime.datetime.now().isoformat(timespec='seconds')
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + '\n', encoding='utf-8')
    print(f'wrote {out}')


if __name__ == '__main__':
    main()

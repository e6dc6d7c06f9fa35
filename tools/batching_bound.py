"""Would one batched model for several seeds train faster than the seeds one by one? The best
case, measured side by side in one process.

Batching k seeds into one model (stacked weights: torch.func.vmap, or bmm) runs each operation
once on k times the rows. Its best case is one model on those k times the rows: the same
operations with one weight matrix where batching would need k. So k x (time of one seed's rows)
/ (time of k seeds' rows in one model) bounds what batching can gain. Both parts of an RL step of
chapter 7's RLConfig from the RL base (chapter 5, from the usual cache):

- sampling: arl.sample_step with tasks_per_step 32 (one seed's 256 episodes) and 32 k;
- the update: arl.rl_update of the same episodes (k x 32 of a step's kept groups) with
  micro_batch_size 32 (one seed's micro-batch, k of them) and 32 k (the k seeds' in one).

Each time is the best of --repeats, the two ways alternating. One torch thread, as the book runs.
Writes the times and ratios, the machine and the date to a JSON file (default
chapters/07_rl_loop/batching.json) that chapter 7 prints; keep a timing only from an idle machine
(the load average before the run is recorded with it).

    .venv/bin/python tools/batching_bound.py                       # k = 2 and 4, 3 repeats
    .venv/bin/python tools/batching_bound.py --ks 2 --repeats 1 --out /tmp/b.json   # smoke
"""
import argparse
import copy
import datetime
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'tools'))
import torch  # noqa: E402
import agentrl as arl  # noqa: E402
from execute import cpu_name  # noqa: E402  (the name the timing record uses)

ROWS = 32     # tasks a step samples, and rows a micro-batch holds, for one seed (RLConfig)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sampling_seconds(base, tasks, tok, k, repeat):
    """(one seed's sample_step, k seeds' tasks in one sample_step) in seconds."""
    cfg = arl.RLConfig()
    env_fn = lambda: arl.make_env(cfg)

    def sample(n_tasks):
        gen = torch.Generator().manual_seed(repeat)
        arl.sample_step(base, env_fn, tasks, tok,
                        arl.RLConfig(tasks_per_step=n_tasks), gen)
    return timed(lambda: sample(ROWS)), timed(lambda: sample(ROWS * k))


def update_seconds(base, batch, k):
    """(k micro-batches of ROWS rows, one micro-batch of k ROWS rows) in seconds: one
    epoch of arl.rl_update over the same episodes each way."""
    def update(rows):
        cfg = arl.RLConfig(micro_batch_size=rows, epochs=1)
        model = copy.deepcopy(base)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        advantages = arl.compute_advantages(batch, cfg)
        return timed(lambda: arl.rl_update(model, optimizer, batch, advantages, cfg))
    return update(ROWS), update(ROWS * k)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ks', type=int, nargs='+', default=[2, 4], help='seeds batched')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--out', type=Path, default=REPO / 'chapters/07_rl_loop/batching.json')
    args = parser.parse_args()
    arl.set_torch_threads()
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    base = arl.make_rl_base(tok)
    tasks = arl.make_tasks('train')
    load_before = os.getloadavg()[0]
    # the episodes to update on: kept groups of one large step, ROWS x max(ks) of them
    cfg = arl.RLConfig(tasks_per_step=ROWS * max(args.ks) * 2)
    kept, _ = arl.sample_step(base, lambda: arl.make_env(cfg), tasks, tok, cfg,
                              torch.Generator().manual_seed(0))
    if len(kept) < ROWS * max(args.ks):
        sys.exit(f'only {len(kept)} kept episodes; need {ROWS * max(args.ks)}')
    rows = []
    for k in args.ks:
        batch = arl.collate(kept[:ROWS * k], tok.pad_id)
        sample, update = [], []
        for repeat in range(args.repeats):
            sample.append(sampling_seconds(base, tasks, tok, k, repeat))
            update.append(update_seconds(base, batch, k))
        one_s, many_s = (min(t[i] for t in sample) for i in (0, 1))
        micro_s, big_s = (min(t[i] for t in update) for i in (0, 1))
        rows.append(dict(k=k, sample_one_s=round(one_s, 3), sample_batched_s=round(many_s, 3),
                         sample_bound=round(k * one_s / many_s, 2),
                         update_separate_s=round(micro_s, 3),
                         update_batched_s=round(big_s, 3),
                         update_bound=round(micro_s / big_s, 2),
                         step_bound=round((k * one_s + micro_s) / (many_s + big_s), 2)))
        print(rows[-1])
    record = dict(date=datetime.date.today().isoformat(), cpu=cpu_name(),
                  load_before=round(load_before, 2), threads=torch.get_num_threads(),
                  repeats=args.repeats, rows_per_seed=ROWS, bounds=rows)
    args.out.write_text(json.dumps(record, indent=1) + '\n')
    print(json.dumps(record, indent=1))


if __name__ == '__main__':
    main()

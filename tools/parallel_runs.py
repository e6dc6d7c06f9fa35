"""Chapter 7's parallel_map measured: the same RL runs one after another and through
parallel_map, side by side in one process, each way into an empty artefact cache of its own.

Both ways train copies of the RL base (chapter 5, from the usual cache) with chapter 7's RLConfig for
--steps steps and no held-out evaluation, through arl.train_rl_cached exactly as the chapters do. The
script checks that the two ways give the same weights, the same histories and byte-identical cache
files, and writes the wall times, their ratio, the machine and the date to a JSON file (default
chapters/07_rl_loop/parallel.json) that chapter 7 prints. A timing is worth keeping only on an idle
machine: the load average before the run is recorded with it.

    .venv/bin/python tools/parallel_runs.py                      # 4 runs of 6 steps, 2 workers
    .venv/bin/python tools/parallel_runs.py --steps 1 --seeds 2 --out /tmp/parallel.json  # smoke
"""
import argparse
import datetime
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'tools'))
import agentrl as arl  # noqa: E402
from execute import cpu_name  # noqa: E402  (the name the timing record uses)


def cache_files(folder):
    """{file name: sha256} of an artefact cache."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir()) if p.is_file()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--seeds', type=int, default=4, help='runs: seeds 0..SEEDS-1')
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--out', type=Path, default=REPO / 'chapters/07_rl_loop/parallel.json')
    args = parser.parse_args()
    arl.set_torch_threads()
    tok = arl.build_tokenizer(arl.make_tasks('all'))
    base = arl.make_rl_base(tok)               # from the usual cache (built once)
    tasks, seeds = arl.make_tasks('train'), list(range(args.seeds))
    load_before = os.getloadavg()[0]

    def run(seed):
        model, history = arl.train_rl_cached(base, tasks, tok, arl.RLConfig(seed=seed),
                                             args.steps)
        return arl.model_hash(model), history

    results, seconds, files = {}, {}, {}
    for way, workers in (('sequential', 1), ('parallel', args.workers)):
        with tempfile.TemporaryDirectory() as cache:
            os.environ['AGENTRL_CACHE'] = cache      # cache_dir() reads it at each call
            start = time.perf_counter()
            results[way] = arl.parallel_map(run, seeds, workers=workers)
            seconds[way] = time.perf_counter() - start
            files[way] = cache_files(cache)
        print(f'{way}: {seconds[way]:.1f} s')
    identical = results['sequential'] == results['parallel'] and (
        files['sequential'] == files['parallel'])
    record = dict(date=datetime.date.today().isoformat(), cpu=cpu_name(),
                  cores=arl.usable_cores(), load_before=round(load_before, 2),
                  runs=len(seeds), steps=args.steps, workers=args.workers,
                  sequential_s=round(seconds['sequential'], 1),
                  parallel_s=round(seconds['parallel'], 1), identical=identical,
                  weights=[h for h, _ in results['parallel']])
    args.out.write_text(json.dumps(record, indent=1) + '\n')
    print(json.dumps(record, indent=1))
    if not identical:
        sys.exit('the two ways differ')


if __name__ == '__main__':
    main()

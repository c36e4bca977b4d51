"""Runs the GPU tests in parallel shards on the GPU machine, to spend less device time.

Most of `pytest -m gpu` is compiling kernel variants (seconds each, one CPU core each); the tests
themselves take little GPU time. This collects the GPU tests, groups them by kernel variant (so
each variant compiles in one shard only), runs the shards as parallel pytest processes on the same
GPU, and prints each shard's summary line. Exits non-zero if any shard fails. Usage:
    PYTHONPATH=$PWD python3 benchmarks/dev_gpu_tests.py [shards] [--deadline S] [pytest paths...]
With --deadline, shards still running S seconds after the start are stopped, and what they had
done is counted from their per-test lines (so a device call's time limit still leaves a count of
every test that ran, and the names of those that did not).
"""
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HEAD_DIMS = {"64", "96", "128", "192", "256"}


def variant_key(node_id: str) -> tuple:
    """The tokens of a test id that pick a kernel variant: dtype, head dim, mask; not head
    counts or sequence lengths (those are runtime values of the same compiled kernel)."""
    name, _, params = node_id.partition("[")
    keep = []
    for tok in params.rstrip("]").split("-"):
        if re.fullmatch(r"\d+", tok) and tok not in HEAD_DIMS:
            continue
        if re.fullmatch(r"h\d+:\d+|\d+x\d+", tok):
            continue
        keep.append(tok)
    return (name.split("::")[0], *keep)


def main():
    args = sys.argv[1:]
    shards = int(args.pop(0)) if args and args[0].isdigit() else 8
    deadline = None
    if "--deadline" in args:
        i = args.index("--deadline")
        deadline = time.monotonic() + float(args[i + 1])
        del args[i:i + 2]
    paths = args or ["tests"]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        capture_output=True, text=True)
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    if not ids:
        print(collected.stdout[-2000:], collected.stderr[-2000:])
        sys.exit("no GPU tests collected")
    groups = defaultdict(list)
    for node_id in ids:
        groups[variant_key(node_id)].append(node_id)
    buckets = [[] for _ in range(shards)]
    for group in sorted(groups.values(), key=len, reverse=True):  # largest first, to the lightest shard
        min(buckets, key=len).extend(group)
    logs = tempfile.mkdtemp(prefix="gpu_shards_")
    procs = []
    for i, bucket in enumerate(b for b in buckets if b):
        log = open(os.path.join(logs, f"shard{i}.log"), "w+")
        procs.append((bucket, log, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *bucket],
            stdout=log, stderr=subprocess.STDOUT, text=True)))
    failed = False
    total = defaultdict(int)
    for i, (bucket, log, p) in enumerate(procs):
        try:
            p.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.seek(0)
        lines = log.read().strip().splitlines()
        if p.returncode is not None and p.returncode < 0:  # stopped at the deadline: count its lines
            done = {m.group(1): m.group(2) for m in
                    (re.match(r"(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", line) for line in lines) if m}
            counts = defaultdict(int)
            for outcome in done.values():
                counts[outcome.lower()] += 1
            missing = [t for t in bucket if t not in done]
            print(f"shard {i}: stopped at the deadline: {dict(counts)}, {len(missing)} not run "
                  f"(first: {missing[:3]})")
            for what, n in counts.items():
                total[what] += n
            total["not run"] += len(missing)
            failed = failed or counts["failed"] + counts["error"] > 0 or bool(missing)
            for t, o in done.items():
                if o in ("FAILED", "ERROR"):
                    print(t, o)
            continue
        summary = lines[-1] if lines else "(no output)"
        print(f"shard {i}: {summary}")
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary):
            total[what] += int(n)
        if p.returncode != 0:
            failed = True
            bad = [line for line in lines if line.startswith(("FAILED", "ERROR", "E "))]
            print("\n".join(bad[:40]))
    print(f"{len(ids)} collected in {len(groups)} variant groups, {len(procs)} shards:", dict(total))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

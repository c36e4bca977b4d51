"""Prints the SASS instructions with the most warp-stall samples from an ncu report (its
source page, `ncu --import R.ncu-rep --page source --csv --print-source sass`, read on the GPU
machine), with each one's main stall reasons, for a kernel profiled with SourceCounters:
    python3 benchmarks/dev_ncu_top.py SASS.csv [count]"""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
count = int(sys.argv[2]) if len(sys.argv) > 2 else 40
start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
hdr, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
col = {h: i for i, h in enumerate(hdr)}
samples = col["Warp Stall Sampling (All Samples)"]
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


total = sum(num(r[samples]) for r in body) or 1.0
print(f"{len(body)} instructions, {total:.0f} samples")
by_reason = {s: sum(num(r[col[s]]) for r in body) for s in stalls}
print("stalls:", ", ".join(f"{s[6:]} {v / total:.1%}" for s, v in
                           sorted(by_reason.items(), key=lambda kv: -kv[1])[:8]))
for r in sorted(body, key=lambda r: -num(r[samples]))[:count]:
    top = sorted(((num(r[col[s]]), s[6:]) for s in stalls), reverse=True)[:2]
    why = ", ".join(f"{name} {v / total:.1%}" for v, name in top if v)
    print(f"{num(r[samples]) / total:6.1%} {r[col['Address']][-5:]} {r[col['Source']].strip()[:60]:60s} {why}")

# The executed instructions by opcode (warp-level counts), and the shared-memory instructions
# with excess wavefronts (bank conflicts): two kernels' mixes side by side show where one issues more
executed = next((h for h in hdr if h.startswith("Instructions Executed")), None)
if executed:
    by_op = {}
    for r in body:
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op] = by_op.get(op, 0.0) + num(r[col[executed]])
    all_ops = sum(by_op.values()) or 1.0
    print(f"\n{all_ops:.4g} warp instructions executed, by opcode:")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {op:12s} {n:12.4g} {n / all_ops:6.1%}")
excess = next((h for h in hdr if "Shared Excessive" in h), None)
if excess:
    worst = sorted(body, key=lambda r: -num(r[col[excess]]))[:12]
    print(f"\nshared excess wavefronts ({excess}):")
    for r in worst:
        if num(r[col[excess]]):
            print(f"  {num(r[col[excess]]):10.4g} {r[col['Address']][-5:]} {r[col['Source']].strip()[:70]}")

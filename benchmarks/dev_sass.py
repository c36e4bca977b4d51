"""SASS of one kernel variant without a GPU: compiles it for CUTE_DSL_ARCH (default sm_90a), runs
nvdisasm on the cubin and prints what a register or schedule question needs: registers, the
instruction count, the eight smallest loops' bodies (between a backward branch and its target)
with their MMA, exponential and address-arithmetic counts, and the opcode histogram. --save
keeps the disassembly; --diff compares two saved ones (opcode counts, and how many positions
of the opcode sequence differ), for A/B between source trees where the device is not at hand:
    python benchmarks/dev_sass.py fwd D MASK [--dtype bf16|fp16|fp8] [--dv DV] [--seqlen N]
        [--varlen] [--save F.sass]
    python benchmarks/dev_sass.py bwd D MASK [--dtype ...] [--varlen] [--save F.sass]
    python benchmarks/dev_sass.py bwd-sm80 D MASK [--dtype ...] [--form bwd,varlen] [--save F.sass]
    python benchmarks/dev_sass.py fwd-sm80 D MASK [--dtype ...] [--varlen | --form decode,...]
        [--save F.sass]
    python benchmarks/dev_sass.py --diff A.sass B.sass
Another source tree: PYTHONPATH=TREE (cuteattn is imported from the path, not from beside this
script). MASK: none, causal, local, softcap. bwd-sm80 and fwd-sm80 (the portable kernels) take
the launch's choice (the first candidate that compiles spill-free) on the target's shared
memory; FORM is tests/sm80_compile_probe.py's (for fwd-sm80: "decode[,page=N][,split]
[,gqa=G]..." the decode kernel, "sink[,varlen]"). nvdisasm 13.4 or newer: `pip install
nvidia-cuda-nvdisasm` (its wheel's nvidia/cu13/bin), or NVDISASM=path. A dev tool: nothing in
cuteattn needs it."""
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*?\((\.L_x_\d+)\)")
# opcode families worth counting in a loop body
FAMILIES = {"mma": ("HGMMA", "HMMA", "QGMMA", "IMMA"), "exp": ("MUFU",),
            "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL"),
            "addr": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "R2UR", "MOV", "ISETP"),
            "shared": ("LDS", "STS", "LDSM", "STSM"), "global": ("LDG", "STG", "RED", "ATOM"),
            "tma/sync": ("UTMALDG", "UTMASTG", "SYNCS", "BAR", "WARPGROUP")}


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not found:
        for base in sys.path:
            hits = glob.glob(os.path.join(base, "nvidia", "cu1*", "bin", "nvdisasm"))
            if hits:
                found = hits[0]
                break
    if not found:
        sys.exit("no nvdisasm: pip install nvidia-cuda-nvdisasm (13.4 or newer), or set NVDISASM")
    return found


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P[0-9T]\s+", "", text)  # (a predicate guard)
    return text.split()[0] if text else ""


def instructions(sass: str) -> tuple:
    """([(address, opcode, text)] in program order, {label: index of its instruction})."""
    out, labels = [], {}
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out.append((int(m[1], 16), opcode(m[2]), m[2]))
        elif LABEL.match(line):
            labels[LABEL.match(line)[1]] = len(out)
    return out, labels


def loops(code: list, labels: dict) -> list:
    """(start, end) indices of each backward branch's body, innermost first."""
    found = []
    for i, (_, op, text) in enumerate(code):
        m = BRANCH.search(text) if op == "BRA" else None
        if m and labels.get(m[1], i + 1) <= i:
            found.append((labels[m[1]], i))
    return sorted(set(found), key=lambda r: r[1] - r[0])


def family_counts(ops) -> dict:
    counts = collections.Counter(ops)
    return {name: sum(n for op, n in counts.items() if op.split(".")[0] in prefixes)
            for name, prefixes in FAMILIES.items()}


def report(sass: str, registers=None):
    code, labels = instructions(sass)
    print(f"instructions {len(code)}" + (f", registers {registers}" if registers else ""))
    for start, end in [r for r in loops(code, labels) if r[1] - r[0] >= 16][:8]:
        ops = [op for _, op, _ in code[start:end + 1]]
        fams = ", ".join(f"{k} {v}" for k, v in family_counts(ops).items() if v)
        print(f"  loop {code[start][0]:#07x}-{code[end][0]:#07x}: {len(ops)} instructions ({fams})")
    hist = collections.Counter(op for _, op, _ in code)
    print("  opcodes: " + ", ".join(f"{op} {n}" for op, n in hist.most_common(40)))


def diff(path_a: str, path_b: str):
    a, b = (instructions(open(p).read())[0] for p in (path_a, path_b))
    ha, hb = (collections.Counter(op for _, op, _ in c) for c in (a, b))
    print(f"instructions {len(a)} -> {len(b)}")
    for op in sorted(set(ha) | set(hb)):
        if ha[op] != hb[op]:
            print(f"  {op:24s} {ha[op]:6d} -> {hb[op]:6d}")
    import difflib
    changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(
        None, [o for _, o, _ in a], [o for _, o, _ in b], autojunk=False).get_opcodes()
        if tag != "equal")
    print(f"  opcode sequence: {changed} positions differ")


def compile_cubin(family: str, d: int, mask: str, opts: dict):
    """(cubin bytes, config, ptxas registers) of the variant."""
    import torch
    from cuteattn.kernels.compile_common import ptxas_report
    from cuteattn.spec import AttentionSpec
    dtype = opts.get("--dtype", "bf16")
    causal, local, softcap = mask == "causal", mask == "local", mask == "softcap"
    varlen = "--varlen" in opts
    if family in ("bwd-sm80", "fwd-sm80"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from sm80_compile_probe import DTYPES, bwd_configs_of, fwd_config_of
        from cuteattn.kernels.compile_common import first_spill_free
        from cuteattn.kernels.sm80 import config as sm80_config
        from cuteattn.kernels.sm80.compile import compile_bwd, compile_fwd
        major, minor = re.match(r"sm_(\d+?)(\d)[a-z]?$", os.environ["CUTE_DSL_ARCH"]).groups()
        smem = sm80_config.SMEM_BY_CAPABILITY[(int(major), int(minor))]
        if family == "bwd-sm80":
            cfgs, build = bwd_configs_of(DTYPES[dtype], d, causal, local, softcap,
                                         opts.get("--form", "bwd"), smem=smem), compile_bwd
        else:
            cfgs = fwd_config_of(dtype, d, mask, opts.get("--form", varlen), smem)
            build = compile_fwd
        cfgs = cfgs if isinstance(cfgs, list) else [cfgs]  # (a decode form's one config)
        cfg, compiled, info = first_spill_free(cfgs, lambda c: ptxas_report(
            lambda: build(c, options="--keep-cubin remarks{ptx}")))
        return compiled.__cubin__, cfg, info.get("registers")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8": torch.float8_e4m3fn}[dtype]
    seqlen = int(opts.get("--seqlen", 16384))
    spec = AttentionSpec(
        dtype=torch_dtype, head_dim=d, head_dim_v=int(opts.get("--dv", d)), causal=causal,
        local=local, has_softcap=softcap, varlen_q=varlen, varlen_k=varlen,
        kind="bwd" if family == "bwd" else "fwd", seqlen_q=seqlen, seqlen_k=seqlen,
        softmax_scale=d ** -0.5, softcap=30.0 if softcap else 0.0,
        window_left=256 if local else None, window_right=0 if local else None)
    if family == "bwd":
        from cuteattn.kernels.sm90.compile import compile_bwd
        from cuteattn.kernels.sm90.launch_bwd import bwd_config
        cfg = bwd_config(spec)
        compiled, info = ptxas_report(lambda: compile_bwd(cfg, options="--keep-cubin remarks{ptx}"))
    else:
        from cuteattn.kernels.sm90.compile import compile_fwd
        from cuteattn.kernels.sm90.launch import sm90_config
        cfg = sm90_config(spec)
        compiled, info = ptxas_report(lambda: compile_fwd(cfg, options="--keep-cubin remarks{ptx}"))
    return compiled.__cubin__, cfg, info.get("registers")


def main(argv):
    if argv[:1] == ["--diff"]:
        return diff(argv[1], argv[2])
    family, d, mask = argv[0], int(argv[1]), argv[2]
    assert family in ("fwd", "bwd", "bwd-sm80", "fwd-sm80"), family
    opts, rest = {}, argv[3:]
    while rest:
        key = rest.pop(0)
        opts[key] = rest.pop(0) if key != "--varlen" else True
    cubin, cfg, registers = compile_cubin(family, d, mask, opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    print(cfg)
    report(sass, registers)
    if "--save" in opts:
        open(opts["--save"], "w").write(sass)


if __name__ == "__main__":
    main(sys.argv[1:])

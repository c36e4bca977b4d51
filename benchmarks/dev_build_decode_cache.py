"""Fills the disk cache with the portable decode kernels of the decode bench's bf16 cells (the
ones dev_decode_ab.py times), compiled here for sm_90a without a GPU, as an H100 / H200 (132 SMs,
227 KB of shared memory a CTA) would launch them, for each setting of config constants given:
    CUTEATTN_CACHE_DIR=$PWD/.kcache python benchmarks/dev_build_decode_cache.py [--batch 1,8] \
        [NAME=INT[,NAME=INT] ...]
Each argument is one variant (NAME=INT sets kernels/sm80/config.NAME; 'base': the defaults).
Carry `.kcache` to the GPU machine with CUTEATTN_DISK_CACHE=1 CUTEATTN_CACHE_DIR=$PWD/.kcache."""
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTEATTN_DISK_CACHE"] = "1"

import torch  # noqa: E402

from cuteattn import kvcache  # noqa: E402
from cuteattn.bench import shapes  # noqa: E402
from cuteattn.kernels.launch_common import use_tvm_ffi  # noqa: E402
from cuteattn.kernels.sm80 import config, launch  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402

SMS, SMEM = 132, 232448


def cell_configs(cell):
    """The decode kernel config a step of this cell launches (kvcache.kvcache_forward's spec,
    _splits' count, DecodeLaunch._fn's config)."""
    spec = AttentionSpec(
        dtype=torch.bfloat16, head_dim=cell.d, head_dim_v=cell.d, causal=False, local=False,
        has_softcap=False, varlen_q=False, varlen_k=False, has_seqused_k=True, kind="decode",
        batch=cell.batch, seqlen_q=1, seqlen_k=cell.seqlen_k, nheads=cell.nheads,
        nheads_k=cell.nheads_k, softmax_scale=cell.d ** -0.5, window_left=-1, window_right=-1,
        paged_kv=cell.page_size is not None, page_size=cell.page_size or 0, device_index=-1)
    tiles, ctas = config.decode_grid(spec, SMS, SMEM)
    splits = kvcache.split_count(tiles, SMS * ctas, -(-cell.seqlen_k // 128))
    split_keys = config.decode_split_keys(spec)
    fold = splits > 1 and config.decode_folds(spec, split_keys, 1, splits)
    return config.decode_config(
        config.cutlass.BFloat16, cell.d, cell.d, False, False, False, False, False,
        cell.page_size or 0, splits > 1, spec.qhead_per_kvhead, smem_limit=SMEM,
        split_keys=split_keys, ctas_per_sm=ctas, fold_combine=fold)


def main():
    args = sys.argv[1:]
    batches = None
    if "--batch" in args:
        i = args.index("--batch")
        batches = args[i + 1].split(",")
        del args[i:i + 2]
    cells = [c for c in shapes.decode_grid() if c.kind == "decode"
             and (batches is None or str(c.batch) in batches)]
    defaults = {}
    for variant in args or ["base"]:
        for name, value in defaults.items():
            setattr(config, name, value)
        for setting in variant.split(","):
            if setting != "base":
                name, value = setting.split("=")
                defaults.setdefault(name, getattr(config, name))
                setattr(config, name, type(getattr(config, name))(int(value)))
        for cell in cells:
            cfg = cell_configs(cell)
            launch._compiled(cfg, use_tvm_ffi())
            print(variant, cell.label(), "tile",
                  (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.kv_stages), "fold",
                  cfg.fold_combine, flush=True)


if __name__ == "__main__":
    main()

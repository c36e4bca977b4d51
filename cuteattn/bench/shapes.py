"""Benchmark cells (one problem shape each) and their algorithmic FLOP counts."""
from __future__ import annotations

from dataclasses import asdict, dataclass

TOKENS = 16384      # batch * seqlen of the default grid, and total tokens of the varlen cells
HIDDEN = 2048       # nheads * head_dim of the default grid
SKEWED = (4096, 512, 3072, 1024, 2560, 1536, 2048, 1536)


def attended_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> int:
    """Exact count of (query, key) pairs a bottom-right aligned mask lets through."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return seqlen_q * seqlen_k
    total = 0
    offset = seqlen_k - seqlen_q
    for i in range(seqlen_q):
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + offset + right)
        lo = 0 if left < 0 else max(0, i + offset - left)
        total += max(0, hi - lo + 1)
    return total


@dataclass(frozen=True)
class Cell:
    kind: str                 # "fwd" (flash_attn_func), "varlen" (flash_attn_varlen_func),
                              # "bwd" (flash_attn_func's backward alone), "fp8" (flash_attn_func
                              # on float8_e4m3fn inputs with descales), "sparse" (block-sparse
                              # flash_attn_func), "decode" (flash_attn_with_kvcache: seqlen_q
                              # new rows, seqlen_k cached keys) or "prefill" (a chunk of
                              # seqlen_q queries over seqlen_k keys in pages:
                              # flash_attn_varlen_func(block_table=))
    d: int
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int             # varlen: the longest sequence
    seqlen_k: int
    causal: bool
    dtype: str = "bf16"
    lens: tuple[int, ...] | None = None   # varlen: per-sequence lengths (q and k alike)
    page_size: int | None = None          # decode, prefill: the cache's page size (None: contiguous)
    sparsity: float | None = None         # sparse: the fraction of logical blocks left out
    block_q: int | None = None            # sparse: the physical block (the logical one is 256)
    block_k: int | None = None
    dv: int | None = None                 # v's head dim where it differs from d
    kv_dtype: str | None = None           # decode: "fp8_e4m3" for an fp8 cache (None: bf16)
    mod: str | None = None                # "mods" cells: MODS' name (a mask_mod or score_mod)

    def kept_blocks(self) -> tuple:
        """Sparse: (logical key blocks each query block keeps, logical key blocks)."""
        blocks = -(-self.seqlen_k // LOGICAL_BLOCK)
        return max(1, round(blocks * (1 - self.sparsity))), blocks

    @property
    def metric(self) -> str:
        """What a cell is measured in: "gbps" (bytes of K/V read) for decode, else "tflops"."""
        return "gbps" if self.kind == "decode" else "tflops"

    def kv_bytes(self) -> int:
        """Decode: the bytes of K and V one call reads (the whole cache of every sequence), in
        the cell's cache dtype (an fp8 cell's bf16 comparison is rated on the same bytes, so
        its rate ratio is the inverse of the time ratio)."""
        elem = 1 if self.kv_dtype else 2
        return 2 * self.batch * self.seqlen_k * self.nheads_k * self.d * elem

    def rate(self, ms: float) -> float:
        """TFLOP/s, or for decode GB/s of K/V read, of one call taking ms milliseconds."""
        if self.kind == "decode":
            return self.kv_bytes() / (ms * 1e-3) / 1e9
        return self.flops() / (ms * 1e-3) / 1e12

    def flops(self) -> float:
        """Forward FLOPs: 4 * heads * d per attended (query, key) pair (two GEMMs, 2 flops a MAC);
        the backward's are 2.5 times that (five GEMMs against two)."""
        if self.kind in ("sparse", "sparse_bwd"):  # only the selected pairs count
            keep, blocks = self.kept_blocks()
            pairs = self.batch * self.seqlen_q * self.seqlen_k * keep / blocks
        elif self.kind in ("mods", "mods_bwd"):  # the pairs the mask_mod (and causal) let through
            pairs = self.batch * mod_pairs(self.mod, self.seqlen_q, self.causal)
        elif self.lens is None:
            pairs = self.batch * attended_pairs(self.seqlen_q, self.seqlen_k, self.causal)
        else:
            pairs = sum(attended_pairs(n, n, self.causal) for n in self.lens)
        # 2 flops per MAC in each GEMM: Q K^T over d, P V over dv
        dims = self.d + (self.d if self.dv is None else self.dv)
        backward = self.kind in ("bwd", "sparse_bwd", "mods_bwd")
        return (2.5 if backward else 1.0) * 2.0 * self.nheads * dims * pairs

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.kind in ("sparse", "sparse_bwd"):
            return (f"{self.kind.replace('_', ' ')} d{self.d} h{self.nheads} S{self.seqlen_q} {self.sparsity:.0%} "
                    f"{self.block_q}x{self.block_k}")
        if self.kind in ("mods", "mods_bwd"):
            kind = self.kind.replace("_", " ")
            return f"{kind} {self.mod} d{self.d} h{self.nheads} S{self.seqlen_q} {mask}"
        if self.kind == "prefill":
            return (f"prefill b{self.batch} {self.seqlen_q}x{self.seqlen_k} h{self.nheads}/"
                    f"{self.nheads_k} page {self.page_size} {mask}")
        if self.kind == "decode":
            cache = f"page {self.page_size}" if self.page_size else "contiguous"
            fp8 = " fp8 cache" if self.kv_dtype else ""
            return f"decode b{self.batch} L{self.seqlen_k} h{self.nheads}/{self.nheads_k} {cache}{fp8}"
        if self.lens is not None:
            shape = "x".join(map(str, self.lens)) if len(set(self.lens)) > 1 else f"{len(self.lens)}x{self.lens[0]}"
            kind = "bwd " if self.kind == "bwd" else ""
            return f"{kind}varlen d{self.d} h{self.nheads} [{shape}] {mask}"
        gqa = f"/{self.nheads_k}" if self.nheads_k != self.nheads else ""
        dims = f"d{self.d}" if self.dv is None else f"d{self.d}/{self.dv}"
        kind = f"{self.kind} " if self.kind in ("bwd", "fp8") else ""
        return f"{kind}{dims} b{self.batch} h{self.nheads}{gqa} {self.seqlen_q}x{self.seqlen_k} {mask}"

    def to_json(self) -> dict:
        out = asdict(self)
        if self.page_size is None and self.kind != "decode":
            del out["page_size"]
        if self.kind != "sparse":
            for name in ("sparsity", "block_q", "block_k"):
                del out[name]
        if self.dv is None:
            del out["dv"]
        if self.kind == "decode":
            out["kv_dtype"] = self.kv_dtype or self.dtype
        else:
            del out["kv_dtype"]
        if self.lens is None:
            del out["lens"]
        else:
            out["lens"] = list(self.lens)
        return out


def fwd_cell(d: int, seqlen: int, causal: bool) -> Cell:
    heads = HIDDEN // d
    return Cell("fwd", d, TOKENS // seqlen, heads, heads, seqlen, seqlen, causal)


def default_grid() -> list[Cell]:
    return [fwd_cell(d, s, c) for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (False, True)]


def bwd_grid(quick: bool = False) -> list[Cell]:
    """The backward alone, on the forward grid's shapes."""
    if quick:
        return [Cell("bwd", 128, TOKENS // s, 16, 16, s, s, c) for s in (1024, 4096) for c in (False, True)]
    return [Cell("bwd", d, TOKENS // s, HIDDEN // d, HIDDEN // d, s, s, c)
            for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (False, True)]


LOGICAL_BLOCK = 256  # VSA's logical block; physical blocks divide it


def sparse_grid(quick: bool = False, bwd: bool = False) -> list[Cell]:
    """FastVideo's shape: bf16, B=1, H=12, d=128, S in {8192, 32768}; dense, 50% and 90% of the
    logical 256x256 blocks left out; physical blocks 128x128, 128x64, 64x64. With bwd the
    backward alone ("sparse_bwd" cells) at the same blocks (64-key lists walked in pairs)."""
    seqlens = (8192,) if quick else (8192, 32768)
    blocks = ((128, 128), (128, 64), (64, 64))
    return [Cell("sparse_bwd" if bwd else "sparse", 128, 1, 12, 12, s, s, False, sparsity=p,
                 block_q=bq, block_k=bk)
            for s in seqlens for p in (0.0, 0.5, 0.9) for bq, bk in blocks]


def surface_grid() -> list[Cell]:
    """The surface shapes: d=192 with dv=128 (16 heads; DeepSeek's MLA prefill) and
    d=80 (24 heads; vision towers: its own width on sm90, padded to 96 on the portable path),
    16k tokens, seqlen 4k and 16k, causal and not; and d=96 at 24 heads beside it."""
    cells = []
    for d, dv, heads in ((192, 128, 16), (80, None, 24), (96, None, 24)):
        for s in (4096, 16384):
            for c in (False, True):
                cells.append(Cell("fwd", d, TOKENS // s, heads, heads, s, s, c, dv=dv))
    return cells


def fp8_grid(quick: bool = False) -> list[Cell]:
    """The forward grid's shapes on fp8 (e4m3) inputs."""
    cells = quick_grid() if quick else default_grid()
    return [Cell("fp8", c.d, c.batch, c.nheads, c.nheads_k, c.seqlen_q, c.seqlen_k, c.causal)
            for c in cells]


def quick_grid() -> list[Cell]:
    return [fwd_cell(128, s, c) for s in (1024, 4096) for c in (False, True)]


def varlen_grid(bwd: bool = False) -> list[Cell]:
    """Packed sequences through flash_attn_varlen_func; bwd: its backward alone (kind "bwd"
    with `lens`)."""
    kind = "bwd" if bwd else "varlen"
    return [Cell(kind, 128, len(lens), 16, 16, max(lens), max(lens), causal, lens=lens)
            for lens in ((2048,) * 8, SKEWED) for causal in (False, True)]


DECODE_SHAPES = ((1, 131072), (8, 32768), (64, 8192), (128, 4096))  # (batch, cache length)


# FlexAttention mods the "mods" cells time (bench/peers.mod_functions builds them):
# document: 4 documents of equal length (a mask_mod reading document ids); sliding: a 1024-key
# window each way (a mask_mod of constants); alibi: ALiBi's bias (a score_mod reading slopes)
MODS = ("document", "sliding", "alibi")
SLIDING = 1024


def mod_pairs(mod: str, seqlen: int, causal: bool) -> int:
    """The (query, key) pairs a MODS entry lets through (with causal on top)."""
    if mod == "document":
        n = seqlen // 4
        per_doc = n * (n + 1) // 2 if causal else n * n
        return 4 * per_doc + (0 if seqlen % 4 == 0 else attended_pairs(seqlen % 4, seqlen % 4, causal))
    if mod == "sliding":
        return attended_pairs(seqlen, seqlen, causal, (SLIDING, SLIDING))
    return attended_pairs(seqlen, seqlen, causal)


def mods_grid(quick: bool = False, bwd: bool = False) -> list[Cell]:
    """bf16, B=1, H=16, d=128, S 8k and 16k, each MODS entry, causal (document, alibi) or not
    (sliding); with bwd the backward alone ("mods_bwd" cells)."""
    seqlens = (8192,) if quick else (8192, 16384)
    return [Cell("mods_bwd" if bwd else "mods", 128, 1, 16, 16, s, s, mod != "sliding", mod=mod)
            for s in seqlens for mod in MODS]


def decode_grid(quick: bool = False, fp8_kv: bool = False) -> list[Cell]:
    """One new query row over a full cache: bf16, 32 query heads over 8 kv heads, d=128, pages of
    16 and 128 tokens and a contiguous cache. fp8_kv: the caches in float8_e4m3fn (with
    descales), at GQA ratios 4 and 8 (the issue's targets differ by ratio)."""
    shapes = DECODE_SHAPES[1:2] if quick else DECODE_SHAPES
    if fp8_kv:
        return [Cell("decode", 128, b, 32, hk, 1, n, False, page_size=p, kv_dtype="fp8_e4m3")
                for b, n in shapes for hk in (8, 4) for p in (16, 128, None)]
    return [Cell("decode", 128, b, 32, 8, 1, n, False, page_size=p)
            for b, n in shapes for p in (16, 128, None)] + prefill_grid(quick)


def prefill_grid(quick: bool = False) -> list[Cell]:
    """A chunked prefill step: 2048 new queries (causal, bottom-right) over a 16k-token paged
    cache, 4 sequences, bf16, 32 query heads over 8, d=128, pages of 16 and 128; beside our
    fixed-length forward on the same keys laid out contiguously."""
    return [Cell("prefill", 128, 4, 32, 8, 2048, 16384, True, page_size=p)
            for p in ((128,) if quick else (16, 128))]


def cpu_grid() -> list[Cell]:
    """Tiny shapes for a machine without CUDA (the reference path)."""
    return [Cell("fwd", 64, 1, 2, 2, 128, 128, c) for c in (False, True)] + [
        Cell("varlen", 64, 3, 2, 2, 96, 96, True, lens=(32, 96, 64)),
        Cell("decode", 64, 2, 4, 2, 1, 64, False, page_size=16),
        Cell("decode", 64, 2, 4, 2, 1, 64, False, kv_dtype="fp8_e4m3"),
        Cell("prefill", 64, 2, 4, 2, 32, 64, True, page_size=16),
        Cell("mods_bwd", 64, 1, 2, 2, 128, 128, True, mod="alibi"),
        Cell("fp8", 64, 1, 2, 2, 64, 64, True),
        Cell("sparse", 64, 1, 2, 2, 512, 512, False, sparsity=0.5, block_q=128, block_k=64),
    ]

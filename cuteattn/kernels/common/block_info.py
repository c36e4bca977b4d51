"""Which key blocks a query tile visits, and which of them need an element-wise mask.

Masks are bottom-right aligned as in FlashAttention: query i of a sequence with lengths
(seqlen_q, seqlen_k) sees key j iff  i + off - left <= j <= i + off + right,  off = seqlen_k - seqlen_q.
Causal is (left, right) = (unbounded, 0). The host passes unbounded sides as a large positive
number, so the kernel never branches on "-1". One source of truth for the forward (and, later,
the backward).
"""
from dataclasses import dataclass

import cutlass
from cutlass import Int32


@dataclass(frozen=True)
class BlockInfo:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    local: cutlass.Constexpr[bool]
    window_left: Int32
    window_right: Int32

    def right(self):
        return Int32(0) if cutlass.const_expr(self.causal) else self.window_right

    def n_block_range(self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32):
        """[n_min, n_max) key blocks for query rows [m_block * tile_m, (m_block + 1) * tile_m).
        Empty (n_max <= n_min) when no row of the tile sees any key."""
        n_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_min = Int32(0)
        if cutlass.const_expr(self.causal or self.local):
            off = seqlen_k - seqlen_q
            m_end = cutlass.min((m_block + 1) * self.tile_m, seqlen_q)
            col_end = m_end + off + self.right()  # exclusive bound for the tile's last row
            n_max = cutlass.min(n_max, cutlass.max((col_end + self.tile_n - 1) // self.tile_n, 0))
            if cutlass.const_expr(self.local):
                col_start = m_block * self.tile_m + off - self.window_left
                n_min = cutlass.max(col_start, 0) // self.tile_n
        return n_min, n_max

    def unmasked_blocks(self, seqlen_q: Int32, seqlen_k: Int32, row_start: Int32, rows: int):
        """[lo, hi): the key blocks that need no element mask for query rows
        [row_start, row_start + rows), by the same rules as needs_mask: every block at or above
        hi holds the sequence end or crosses the causal/right diagonal, every block below lo
        crosses the left window edge (lo > hi: none is free of masks). Lets a loop run its
        middle blocks without the mask code, which ptxas otherwise predicates into every
        iteration (64 selects per thread per block at 128x128)."""
        hi = seqlen_k // self.tile_n  # (n + 1) * tile_n > seqlen_k from here on
        if cutlass.const_expr(self.causal or self.local):
            off = seqlen_k - seqlen_q
            # col_last > row_start + off + right  <=>  n >= (row_start + off + right + 1) // tile_n
            hi = cutlass.min(hi, cutlass.max(row_start + off + self.right() + 1, 0) // self.tile_n)
        lo = Int32(0)
        if cutlass.const_expr(self.local):
            # col_start < row_start + rows - 1 + off - left  <=>  n < ceil(that / tile_n)
            edge = row_start + rows - 1 + (seqlen_k - seqlen_q) - self.window_left
            lo = (cutlass.max(edge, 0) + self.tile_n - 1) // self.tile_n
        return lo, hi

    def needs_mask(self, seqlen_q: Int32, seqlen_k: Int32, row_start: Int32, rows: int,
                   n_block: Int32):
        """Whether key block n_block has any masked element for query rows
        [row_start, row_start + rows): the sequence end, the causal/right diagonal, the left edge."""
        return self.needs_mask_keys(seqlen_q, seqlen_k, row_start, rows, n_block * self.tile_n,
                                    self.tile_n)

    def needs_mask_keys(self, seqlen_q: Int32, seqlen_k: Int32, row_start: Int32, rows: int,
                        col_start: Int32, keys: int):
        """needs_mask for the keys [col_start, col_start + keys) (a half of a block-sparse pair)."""
        col_last = col_start + keys - 1
        masked = col_last >= seqlen_k
        if cutlass.const_expr(self.causal or self.local):
            off = seqlen_k - seqlen_q
            masked = masked | (col_last > row_start + off + self.right())
            if cutlass.const_expr(self.local):
                masked = masked | (col_start < row_start + rows - 1 + off - self.window_left)
        return masked

    def key_block_runs(self, seqlen_q: Int32, seqlen_k: Int32, row_start: Int32, rows: int,
                       n_min: Int32, n_max: Int32):
        """The block iterator of a dense key range: the mainloop's iterations after the first
        (iteration i visits key block n_max - 1 - i, from the last block down) as runs of
        (first, stop, masked): the masked blocks at the top (sequence end, causal or right
        diagonal), the unmasked middle, and with a window the masked left edge. `masked` is a
        compile-time bool, so the middle run carries no mask code: in one loop that checks
        each block, ptxas predicates the mask into every iteration (at d=128, 128x128, the loop
        body had 620 SASS instructions against 487 split). Runs may be empty. Iteration 0 (the
        top block) is the caller's, always masked as `needs_mask` says.
        A split-KV range or a sparse block list is another iterator of the same shape."""
        n_blocks = n_max - n_min
        lo, hi = self.unmasked_blocks(seqlen_q, seqlen_k, row_start, rows)
        end_top = cutlass.max(cutlass.min(n_max - hi, n_blocks), 1)
        start_left = cutlass.max(cutlass.min(n_max - lo, n_blocks), end_top)
        runs = [(Int32(1), end_top, True), (end_top, start_left, False)]
        if cutlass.const_expr(self.local):
            runs.append((start_left, n_blocks, True))
        return runs

    # ---- the backward's view: the query blocks that see a key block ----

    def m_block_range(self, seqlen_q: Int32, seqlen_k: Int32, n_block: Int32):
        """[m_min, m_max) query blocks whose rows see some key of block n_block (by the same
        visibility rule as n_block_range; empty when none does). Both ends are monotonic in
        n_block, so the key blocks that visit one query block are consecutive
        (`first_key_block` is the first)."""
        m_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_min = Int32(0)
        if cutlass.const_expr(self.causal or self.local):
            off = seqlen_k - seqlen_q
            # query i sees key j only if j <= i + off + right: i >= n * tile_n - off - right
            m_min = cutlass.max(n_block * self.tile_n - off - self.right(), 0) // self.tile_m
            if cutlass.const_expr(self.local):
                # and only if j >= i + off - left: i <= (n + 1) * tile_n - 1 - off + left
                rows = (n_block + 1) * self.tile_n - off + self.window_left  # last row + 1
                m_max = cutlass.min(m_max, (cutlass.max(rows, 0) + self.tile_m - 1) // self.tile_m)
        return m_min, m_max

    def last_key_block(self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32):
        """The last key block whose m_block_range holds m_block (the last of the sequence
        unless the causal or right diagonal ends the range early): m_min(n) <= m_block
        <=> n * tile_n - off - right < (m_block + 1) * tile_m."""
        last = (seqlen_k + self.tile_n - 1) // self.tile_n - 1
        if cutlass.const_expr(self.causal or self.local):
            edge = (m_block + 1) * self.tile_m + (seqlen_k - seqlen_q) + self.right()
            last = cutlass.min(last, (cutlass.max(edge, 0) + self.tile_n - 1) // self.tile_n - 1)
        return last

    def first_key_block(self, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32):
        """The first key block whose m_block_range holds m_block (the key blocks that do are
        consecutive from here): 0 unless a left window ends the range early."""
        first = Int32(0)
        if cutlass.const_expr(self.local):
            # m_block < m_max(n)  <=>  (n + 1) * tile_n >= m_block * tile_m + 1 + off - left
            need = m_block * self.tile_m + 1 + (seqlen_k - seqlen_q) - self.window_left
            first = cutlass.max((cutlass.max(need, 0) + self.tile_n - 1) // self.tile_n - 1, 0)
        return first

    def needs_mask_transposed(self, seqlen_q: Int32, seqlen_k: Int32, key_start: Int32,
                              keys: int, q_start: Int32):
        """Whether keys [key_start, key_start + keys) against query block q_start (tile_m rows)
        have any masked element: either sequence end, the causal/right diagonal, the left edge."""
        key_last = key_start + keys - 1
        q_last = q_start + self.tile_m - 1
        masked = (key_last >= seqlen_k) | (q_last >= seqlen_q)
        if cutlass.const_expr(self.causal or self.local):
            off = seqlen_k - seqlen_q
            masked = masked | (key_last > q_start + off + self.right())
            if cutlass.const_expr(self.local):
                masked = masked | (key_start < q_last + off - self.window_left)
        return masked


@dataclass(frozen=True)
class DenseBlocks:
    """The key blocks of a dense tile, [n_min, n_max), visited from the last down (the masked
    blocks at the sequence end and the diagonal first). block_sparse.SparseBlocks is the other
    visit order with these methods."""
    n_min: Int32
    n_max: Int32

    def count(self):
        return self.n_max - self.n_min

    def any(self):
        return self.n_max > self.n_min

    def none(self):
        return self.n_max <= self.n_min

    def first(self):
        return self.n_max - 1

    def block(self, i):
        """The i-th block visited (i from 0)."""
        return self.n_max - 1 - i


@dataclass(frozen=True)
class DenseRows:
    """The backward's query steps of a dense key block: m_block in [m_min, m_max), each its own
    step (block_sparse.SparseRows is the other order with these methods). The loop runs
    `for it in range(start(), stop())` with m_block = block(it)."""
    m_min: Int32
    m_max: Int32

    def start(self):
        return self.m_min

    def stop(self):
        return self.m_max

    def block(self, it):
        return it

    def stage(self, it):
        """Which of two alternating buffers step `it` uses."""
        return (it - self.m_min) % 2

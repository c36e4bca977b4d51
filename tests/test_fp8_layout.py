"""CPU checks of the fp8 forward's operand order (no GPU): the P fragment's register mapping
(convert.fp8_p_fragment), the key order it implies (FP8_KEY_ORDER), and V transposed in that
order (launch.fp8_value_operand), checked by simulating every thread of a warpgroup's fragments."""
import torch

from cuteattn.kernels.common.convert import FP8_KEY_ORDER
from cuteattn.kernels.sm90.launch import fp8_value_operand


def accumulator_column(f: int, t: int) -> int:
    """The key column of a wgmma accumulator's value f (flat ((2, 2, N/8)) index) in a thread
    with t = lane % 4: f = j + 2h + 4g holds column 8g + 2t + j of row half h."""
    j, g = f % 2, f // 4
    return 8 * g + 2 * t + j


def a_operand_slot(a: int, t: int) -> int:
    """The k slot of an e4m3 A operand's value a (flat ((4, 2, 2), 1, K/32) index): a = b + 4h +
    8kh + 16c holds slot 32c + 16kh + 4t + b of row half h."""
    b, kh, c = a % 4, (a // 8) % 2, a // 16
    return 32 * c + 16 * kh + 4 * t + b


def test_fragment_mapping_matches_key_order():
    """fp8_p_fragment writes word w's bytes from accumulator values f, f+1, f+4, f+5 (f = 2h +
    8kh + 16c): for every thread, the A slot each value lands in holds the key FP8_KEY_ORDER
    says, and rows (h) are preserved; every key of a 64-key block is used once per row half."""
    keys = 64
    for t in range(4):
        seen = set()
        for w in range(keys // 8):  # (64 rows x 64 keys) / 128 threads / 4 bytes per word
            h, kh, c = w % 2, (w // 2) % 2, w // 4
            f = 2 * h + 8 * kh + 16 * c
            for byte, src in enumerate((f, f + 1, f + 4, f + 5)):
                a = 4 * w + byte
                assert (a // 4) % 2 == (src // 2) % 2 == h  # the same row half
                slot, key = a_operand_slot(a, t), accumulator_column(src, t)
                assert key == 16 * (slot // 16) + FP8_KEY_ORDER[slot % 16]
                seen.add((h, key))
        assert len(seen) == keys // 2  # this thread's 16 columns x 2 row halves


def test_key_order_is_a_permutation():
    assert sorted(FP8_KEY_ORDER) == list(range(16))


def test_value_operand_transposes_in_key_order():
    """V (b, s, hk, dv) -> (b, hk, dv, s rounded up to 16): column 16G + s holds key 16G +
    FP8_KEY_ORDER[s]; the keys past the end are zero."""
    b, s, hk, dv = 2, 37, 3, 32
    v = (torch.randn(b, s, hk, dv) * 4).to(torch.float8_e4m3fn)
    vt, cu_v = fp8_value_operand(v)
    assert cu_v is None
    assert vt.dtype == torch.uint8 and vt.shape == (b, hk, dv, 48) and vt.is_contiguous()
    raw = v.view(torch.uint8)
    for col in range(48):
        key = 16 * (col // 16) + FP8_KEY_ORDER[col % 16]
        expect = raw[:, key] if key < s else torch.zeros(b, hk, dv, dtype=torch.uint8)
        assert torch.equal(vt[..., col], expect), col


def test_value_operand_packed_sequences():
    """Packed V: each sequence's keys from a 16-aligned column (cu_v), rounded up to 16 keys
    with zeros, in key order; empty sequences take no columns; the columns past the last are
    zero."""
    lens = [5, 0, 16, 33]
    hk, dv = 2, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    v = (torch.randn(sum(lens), hk, dv) * 4).to(torch.float8_e4m3fn)
    vt, cu_v = fp8_value_operand(v, cu)
    assert cu_v.tolist() == [0, 16, 16, 32, 80]
    assert vt.shape == (hk, dv, -(-(sum(lens) + 16 * len(lens)) // 16) * 16)
    raw = v.view(torch.uint8)
    for b, n in enumerate(lens):
        for col in range(-(-n // 16) * 16):
            key = 16 * (col // 16) + FP8_KEY_ORDER[col % 16]
            want = raw[cu[b] + key] if key < n else torch.zeros(hk, dv, dtype=torch.uint8)
            assert torch.equal(vt[:, :, cu_v[b] + col], want), (b, col)
    assert not vt[:, :, 80:].any()


def test_value_keys_past_seqused_zeroed():
    """launch.zero_value_keys_past: V^T of batched and of packed V with each sequence's keys
    from its seqused_k on zeroed equals V^T of V whose rows past seqused_k were zero (NaN bytes
    there before: memory the call does not own), the other keys untouched."""
    from cuteattn.kernels.sm90.launch import zero_value_keys_past
    hk, dv = 2, 16
    nan_byte = 0x7F  # (e4m3's NaN)
    # batched: (b, s, h_k, d_v), seqused 0, 5, 16, 37 (all) of 37
    v = (torch.randn(4, 37, hk, dv) * 4).to(torch.float8_e4m3fn)
    used = torch.tensor([0, 5, 16, 37], dtype=torch.int32)
    clean = v.clone()
    for b, n in enumerate(used.tolist()):
        v.view(torch.uint8)[b, n:] = nan_byte
        clean.view(torch.uint8)[b, n:] = 0
    vt, cu_v = fp8_value_operand(v)
    zero_value_keys_past(vt, cu_v, used)
    assert torch.equal(vt, fp8_value_operand(clean)[0])
    # packed: lengths 5, 0, 16, 33 with seqused 3, 0, 16, 20
    lens, used = [5, 0, 16, 33], torch.tensor([3, 0, 16, 20], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    v = (torch.randn(sum(lens), hk, dv) * 4).to(torch.float8_e4m3fn)
    clean = v.clone()
    for b, n in enumerate(used.tolist()):
        v.view(torch.uint8)[cu[b] + n:cu[b + 1]] = nan_byte
        clean.view(torch.uint8)[cu[b] + n:cu[b + 1]] = 0
    vt, cu_v = fp8_value_operand(v, cu)
    zero_value_keys_past(vt, cu_v, used)
    want, want_cu = fp8_value_operand(clean, cu)
    assert torch.equal(cu_v, want_cu) and torch.equal(vt, want)

"""Pieces shared by the forward and backward kernels: tile loads, the key range of a query tile."""
import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, desc, b, row, h, rows, n_rows, d_ok, MASKED: tl.constexpr, PAD_D: tl.constexpr,
              TMA: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (ROWS, BLOCK_D) tile of a (B, S, H, D) tensor: rows row.. of batch b, head h.

    TMA: through the tensor-memory engine from a descriptor with block [1, ROWS, 1, BLOCK_D]
    (rows past the end and columns past D read as 0). Otherwise by pointers (`ptrs`), masking
    rows >= n_rows when MASKED and columns past D when PAD_D.
    """
    if TMA:
        return tl.reshape(desc.load([b, row, h, 0]), (ROWS, BLOCK_D))
    elif MASKED:
        mask = rows[:, None] < n_rows
        if PAD_D:
            mask = mask & d_ok
        return tl.load(ptrs, mask=mask, other=0.0)
    elif PAD_D:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def key_range(pid_m, q_start, k_start, Sq, Sk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """For query tile pid_m: (hi, full_end). Keys [0, hi) are visible to some row of the tile;
    [0, full_end) are whole BLOCK_N blocks visible to every row (no mask needed); the rest of
    [full_end, hi) needs the causal and bounds mask."""
    if CAUSAL:
        first_q = q_start + pid_m * BLOCK_M
        last_q = q_start + tl.minimum((pid_m + 1) * BLOCK_M, Sq) - 1
        hi = tl.minimum(tl.maximum(last_q - k_start + 1, 0), Sk)
        full_end = tl.minimum(tl.maximum(first_q - k_start + 1, 0), hi)
    else:
        hi = Sk
        full_end = Sk
    return hi, (full_end // BLOCK_N) * BLOCK_N

"""Tile loads shared by the forward and backward kernels."""
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

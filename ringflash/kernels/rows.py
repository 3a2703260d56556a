"""Moving whole rows between tensors: a ring block's rows into the keys gathered in global order
(ring._gather_block), each row one contiguous run of columns. On one H100 torch's index_copy_
took 0.12 ms for a packed ring block's K and V (64 MiB each way, a third of the memory's
bandwidth), this copy ~0.056 ms (benchmarks/RESULTS.md, "The forward's steps in runs")."""

import triton
import triton.language as tl


@triton.jit
def _scatter_rows_kernel(
    src, dst, rows, n, width, src_stride_b, src_stride_r, dst_stride_b, dst_stride_r,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """dst[b, rows[i], :width] = src[b, i, :width] for i < n; a program per BLOCK_R rows and
    BLOCK_W columns of batch b (program_id 2)."""
    b = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_rows = r < n
    to = tl.load(rows + r, mask=in_rows, other=0).to(tl.int64)
    m = in_rows[:, None] & (w[None, :] < width)
    x = tl.load(src + b * src_stride_b + r.to(tl.int64)[:, None] * src_stride_r + w[None, :], mask=m)
    tl.store(dst + b * dst_stride_b + to[:, None] * dst_stride_r + w[None, :], x, mask=m)

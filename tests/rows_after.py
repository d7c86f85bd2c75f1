"""GPU outputs that are the first rows of a larger tensor, for the GEMM tests that check
a kernel stores no row past M (tiles of M padded to whole tiles must not reach memory)."""
#: Rows after the output, each element :data:`MARK`.
ROWS = 128
MARK = 7


def output_with_rows_after(torch, m, n, dtype):
    """A zeroed ``[m, n]`` CUDA tensor of ``dtype`` that is the first rows of a larger
    one, and the larger one."""
    whole = torch.full((m + ROWS, n), MARK, dtype=dtype, device="cuda")
    whole[:m] = 0
    return whole[:m], whole


def check_rows_after(whole, m):
    """Whether the rows of ``whole`` past ``m`` still hold :data:`MARK`."""
    assert bool((whole[m:] == MARK).all()), f"the kernel stored rows past the output's {m}"

"""What a fused product does around `A @ W.T` (the MODE of the kernels in
torch_triton_products.py); apart so that the forward can name them without importing
Triton (the CPU engine never does)."""

STORE = 0  # out = A @ W.T (+ bias)
ACCUMULATE = 1  # out += A @ W.T (the residual stream)
SILU_GATE = 2  # W = [gate; up]: out = silu(A @ gate.T) * (A @ up.T)

"""Fast operations for training: the chunked LM head + cross-entropy, fused norm/RoPE/SwiGLU kernels, FP8 matmuls."""

"""How the models run: rlhflab's native Llama runtime, lean activations, the CPU matmul library, fused AdamW, the allocator."""

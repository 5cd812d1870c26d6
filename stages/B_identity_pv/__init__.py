"""Stage B: two MMAs with identity softmax, O = bf16(Q·Kᵀ)·V, with P kept on chip."""

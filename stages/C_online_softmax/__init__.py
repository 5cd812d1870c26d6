"""Stage C: online softmax between the two MMAs (one CTA, hd = 64): O = softmax(Q·Kᵀ/√hd)·V and LSE."""

"""The gather verbs (cpshard.transport): references, bad input on one rank, check modes,
torch.compile."""

"""The native ops (cpshard.ops): forward/backward against references, bad arguments,
torch.compile, fuzzing, the CUDA kernels."""

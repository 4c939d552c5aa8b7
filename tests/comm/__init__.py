"""The communication layer (cpshard.comm): the native NCCL communicator and its bootstrap."""

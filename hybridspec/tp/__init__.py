"""Tensor parallelism: one model split by heads and columns over the ranks of
a torch.distributed process group (gloo on CPU, NCCL on GPUs).

Every rank runs the same Engine over the same requests (SPMD): its model holds
a shard of every layer (`shard.shard_weights`) and its caches hold that
shard's K/V heads and recurrent state, snapshots and input logs; the partial
outputs of the row-parallel products are summed across ranks
(`TensorParallel.all_reduce`), so every rank sees the same hidden states and
logits, samples the same tokens with the same keyed noise, and commits every
layer to the same boundary. Decisions made from timings (adaptive γ, the
measured costs of `CheckpointPolicy.auto`) are made on rank 0 and broadcast.
"""
from hybridspec.tp.group import TensorParallel
from hybridspec.tp.shard import shard_weights

__all__ = ["TensorParallel", "shard_weights"]

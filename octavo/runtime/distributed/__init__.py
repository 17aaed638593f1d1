"""Tensor and pipeline parallel execution on torch.distributed: rank 0's runtime and the worker ranks.

The parallel passes (octavo.passes.shard_tensor_parallel, split_pipeline_stages) run at load time,
so one artifact serves every parallel size; see docs/distributed.md.
"""

from octavo.runtime.distributed.runtime import DistributedExecutor, ParallelRuntime

__all__ = ["DistributedExecutor", "ParallelRuntime"]

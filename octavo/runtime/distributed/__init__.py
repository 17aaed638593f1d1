"""Tensor and pipeline parallel execution on torch.distributed: rank 0's runtime and the worker ranks' step loop.

The runtime runs rank programs but does not make them: sharding an artifact
for a rank runs the parallel passes, in octavo.parallel (the layer above the
runtime and the passes), which hands the engine a RankLaunch. See
docs/distributed.md.
"""

from octavo.runtime.distributed.runtime import DistributedExecutor, ParallelRuntime

__all__ = ["DistributedExecutor", "ParallelRuntime"]

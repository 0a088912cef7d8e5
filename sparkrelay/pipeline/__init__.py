"""Pipeline parallelism: the layer -> stage partition, the step descriptor, stage-to-stage sends, stage workers."""

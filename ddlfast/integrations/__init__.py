"""Framework integrations over the public ddlfast API: PyTorch (`ddlfast.torch`: GradientReducer,
DistributedOptimizer, DDP communication hooks, the "ddlfast" torch.distributed backend)."""

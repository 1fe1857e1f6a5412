"""pipeplan's runtime: execute a plan.json's schedule over torch.distributed."""

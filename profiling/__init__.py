"""NVTX ranges, torch.profiler traces, reports and the glm5-lab command line."""

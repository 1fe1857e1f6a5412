"""pipeplan's profiler: load a user's model.py, trace it into a layer graph, measure each layer."""

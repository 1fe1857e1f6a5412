"""pipeplan's profiler: load a user's model.py, trace it into a layer graph, measure each layer.

Modules: `loader` (the model-file contract, `load_model_file`, `file_sha256`), `tracing`
(torch.fx / torch.export capture, internal), `segment` (nodes -> layers, internal), `graph`
(`trace` -> LayerGraph, `build_stage` -> StageModule: the API the runtime builds stages with),
`measure` (times and bytes), `profile` (`profile_model_file` -> planner.formats.Profile).
"""

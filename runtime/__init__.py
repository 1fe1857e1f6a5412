"""pipeplan's runtime: execute a plan.json's schedule over torch.distributed.

Semantics are exactly those of single-device training: every rank seeds with `--seed`, builds
the whole model, keeps only its stage (built by the profiler's tracing code); step s's global
batch is `make_batch(global_batch)`, called once per step right after torch's, random's and
numpy's global generators are seeded with seed + s (`rng.seed_batch`), and cut into
microbatches in order; replica k of a stage takes microbatches j with j % r == k; the loss is
the mean over microbatches; replicas' gradients are summed within the stage's process group
(and tied parameters' gradients between the stages holding them); the optimizer steps once per
iteration after the flush (PipeDream-Flush). Stages call the user's own block modules. Each
forward draws random numbers from its own stream seeded by (seed, step, stage, microbatch), and
replicated stages make their buffers consistent after every step (runtime/rng.py says what this
guarantees against single-device training).

Modules: cli (entry point, pre-flight checks), launch (local processes), worker (one rank),
executor (one rank's actions), comm (point-to-point transfers), stages (building stages and
the routing), rng (random streams and buffer consistency), checkpoint (--save/--resume), report
(report.json and the measured trace).
"""
